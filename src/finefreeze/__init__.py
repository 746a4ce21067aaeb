"""finefreeze: freeze any part of a Keras 3 / TensorFlow model, exactly.

Example:
    >>> import finefreeze as ff
    >>> ff.Plan([ff.freeze("**"), ff.train("head/**")])
    Plan([freeze('**'), train('head/**')])
"""

from finefreeze import callbacks as callbacks
from finefreeze._blocks import Block as Block
from finefreeze._blocks import Blocks as Blocks
from finefreeze._blocks import blocks as blocks
from finefreeze._delta import load_delta as load_delta
from finefreeze._errors import DeltaError as DeltaError
from finefreeze._errors import DistributionError as DistributionError
from finefreeze._errors import FreezeWarning as FreezeWarning
from finefreeze._errors import FrozenValueChanged as FrozenValueChanged
from finefreeze._errors import PlanError as PlanError
from finefreeze._freezer import Freezer as Freezer
from finefreeze._optimizer import FreezingOptimizer as FreezingOptimizer
from finefreeze._plan import Plan as Plan
from finefreeze._rules import Rule as Rule
from finefreeze._rules import freeze as freeze
from finefreeze._rules import train as train
from finefreeze._version import __version__ as __version__

__all__ = [
    "Block",
    "Blocks",
    "blocks",
    "DeltaError",
    "DistributionError",
    "FreezeWarning",
    "Freezer",
    "FreezingOptimizer",
    "FrozenValueChanged",
    "Plan",
    "PlanError",
    "Rule",
    "__version__",
    "callbacks",
    "freeze",
    "load_delta",
    "train",
]
