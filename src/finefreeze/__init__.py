"""finefreeze: freeze any part of a Keras 3 model, exactly.

``import finefreeze`` is light: it imports neither Keras nor TensorFlow.
Each public name is imported on first use, and the Keras classes that
finefreeze saves in model files are registered as soon as Keras is
imported, so ``keras.models.load_model`` finds them (one mechanism:
``finefreeze._imports``).

Example:
    >>> import finefreeze as ff
    >>> ff.Plan([ff.freeze("**"), ff.train("head/**")])
    Plan([freeze('**'), train('head/**')])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from finefreeze._imports import PUBLIC, load, register_keras_classes, when_imported
from finefreeze._version import __version__ as __version__

if TYPE_CHECKING:  # what static tools see; at run time names are imported on first use
    from finefreeze import callbacks as callbacks
    from finefreeze import tf1 as tf1
    from finefreeze._errors import DeltaError as DeltaError
    from finefreeze._errors import DistributionError as DistributionError
    from finefreeze._errors import FreezeWarning as FreezeWarning
    from finefreeze._errors import FrozenValueChanged as FrozenValueChanged
    from finefreeze._errors import PlanError as PlanError
    from finefreeze._files.delta import load_delta as load_delta
    from finefreeze._files.merge import merge_deltas as merge_deltas
    from finefreeze._files.switch import DeltaSwitch as DeltaSwitch
    from finefreeze._freezer.freezer import Freezer as Freezer
    from finefreeze._hub.tokens import add_tokens as add_tokens
    from finefreeze._optimizer.wrapper import FreezingOptimizer as FreezingOptimizer
    from finefreeze._plan.plan import Plan as Plan
    from finefreeze._plan.rules import Rule as Rule
    from finefreeze._plan.rules import freeze as freeze
    from finefreeze._plan.rules import train as train
    from finefreeze._resolve.blocks import blocks as blocks
    from finefreeze._select.select import select as select

__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name not in PUBLIC:
        raise AttributeError(f"module 'finefreeze' has no attribute {name!r}")
    value = globals()[name] = load(name)  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))


when_imported("keras", after=register_keras_classes)
