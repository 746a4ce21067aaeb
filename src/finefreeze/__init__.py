"""finefreeze: freeze any part of a Keras 3 / TensorFlow model, exactly.

``import finefreeze`` is light: it imports neither Keras nor TensorFlow.
Each public name loads its private module on first use (PEP 562), and the
Keras classes finefreeze saves in model files (``FreezingOptimizer``, the
layers of :mod:`finefreeze.layers`) are registered as soon as Keras is
imported, so ``keras.models.load_model`` finds them.

Example:
    >>> import finefreeze as ff
    >>> ff.Plan([ff.freeze("**"), ff.train("head/**")])
    Plan([freeze('**'), train('head/**')])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from finefreeze._keras_hook import finish_pending, register_when_keras_loads
from finefreeze._version import __version__ as __version__

if TYPE_CHECKING:  # what static tools see; at run time the table below loads them on use
    from finefreeze import callbacks as callbacks
    from finefreeze import layers as layers
    from finefreeze._errors import DeltaError as DeltaError
    from finefreeze._errors import DistributionError as DistributionError
    from finefreeze._errors import FreezeWarning as FreezeWarning
    from finefreeze._errors import FrozenValueChanged as FrozenValueChanged
    from finefreeze._errors import PlanError as PlanError
    from finefreeze._files.delta import load_delta as load_delta
    from finefreeze._files.merge import merge_deltas as merge_deltas
    from finefreeze._files.switch import DeltaSwitch as DeltaSwitch
    from finefreeze._freezer.freezer import Freezer as Freezer
    from finefreeze._optimizer.wrapper import FreezingOptimizer as FreezingOptimizer
    from finefreeze._plan.plan import Plan as Plan
    from finefreeze._plan.rules import Rule as Rule
    from finefreeze._plan.rules import freeze as freeze
    from finefreeze._plan.rules import train as train
    from finefreeze._resolve.blocks import Block as Block
    from finefreeze._resolve.blocks import Blocks as Blocks
    from finefreeze._resolve.blocks import blocks as blocks
    from finefreeze._select.select import select as select

#: public name -> the module that defines it ("" for a public submodule)
_LAZY = {
    "Block": "finefreeze._resolve.blocks",
    "Blocks": "finefreeze._resolve.blocks",
    "blocks": "finefreeze._resolve.blocks",
    "DeltaError": "finefreeze._errors",
    "DeltaSwitch": "finefreeze._files.switch",
    "DistributionError": "finefreeze._errors",
    "FreezeWarning": "finefreeze._errors",
    "Freezer": "finefreeze._freezer.freezer",
    "FreezingOptimizer": "finefreeze._optimizer.wrapper",
    "FrozenValueChanged": "finefreeze._errors",
    "Plan": "finefreeze._plan.plan",
    "PlanError": "finefreeze._errors",
    "Rule": "finefreeze._plan.rules",
    "callbacks": "",
    "freeze": "finefreeze._plan.rules",
    "layers": "",
    "load_delta": "finefreeze._files.delta",
    "merge_deltas": "finefreeze._files.merge",
    "select": "finefreeze._select.select",
    "train": "finefreeze._plan.rules",
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'finefreeze' has no attribute {name!r}")
    value = (
        importlib.import_module(f"finefreeze.{name}") if where == "" else getattr(importlib.import_module(where), name)
    )
    globals()[name] = value  # later lookups skip this function
    finish_pending()
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


register_when_keras_loads()
