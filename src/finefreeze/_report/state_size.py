"""Optimizer state per trained element, named after the optimizer actually wrapped.

The report's state column counts the elements of optimizer state (moments,
accumulators, EMA copies) the plan leaves. How many a trained element costs
depends on the optimizer and its settings (SGD without momentum: none, Adam:
two, Adam with ``amsgrad``: three, anything with ``use_ema``: one more), so
it is measured: a copy of the optimizer, made from its config, is built on a
small vector and its per-element variables are counted. Before a Freezer has
wrapped an optimizer, Adam is assumed and the label says so.
"""

from __future__ import annotations

import functools
import json

import numpy as np

__all__ = ["describe", "optimizer_state"]

_PROBE = 7  # a vector length no optimizer scalar has


@functools.lru_cache(maxsize=64)
def _slots(cls, config_json: str) -> int | None:
    import keras

    try:
        opt = cls.from_config(json.loads(config_json))
        v = keras.Variable(np.zeros((_PROBE,), "float32"), name="probe")
        opt.build([v])
    except Exception:  # a custom optimizer that cannot be rebuilt from its config
        return None
    return sum(1 for w in opt.variables if tuple(w.shape) == (_PROBE,))


def optimizer_state(frz) -> tuple[str, int | None]:
    """The column label and state elements per trained element for ``frz``'s optimizer.

    Args:
        frz: a :class:`Freezer`.

    Returns:
        ``("Adam state", 2)`` and the like; the count is None when it cannot
        be measured. The optimizer is the one compiled into the model, else
        the one wrapped last. Before any ``wrap``: ``("state (Adam)", 2)``.

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> w = keras.Variable(np.zeros((3,), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
        >>> optimizer_state(frz)
        ('state (Adam)', 2)
        >>> _ = frz.wrap(keras.optimizers.SGD(0.1, momentum=0.9))
        >>> optimizer_state(frz)
        ('SGD state', 1)
        >>> _ = frz.wrap(keras.optimizers.AdamW())   # the wrapper dropped at once: still named
        >>> optimizer_state(frz)
        ('AdamW state', 2)
    """
    opts = frz._optimizers()
    compiled = getattr(getattr(getattr(frz, "_target", None), "obj", None), "optimizer", None)
    while compiled is not None and compiled not in opts:
        compiled = getattr(compiled, "inner_optimizer", None)  # through a LossScaleOptimizer
    if compiled is not None:
        cls, config = describe(compiled.inner_optimizer)
    elif opts:
        cls, config = describe(opts[-1].inner_optimizer)
    elif getattr(frz, "last_wrapped", None) is not None:  # wrapped, and the wrapper already dropped
        cls, config = frz._last_wrapped
    else:
        return "state (Adam)", 2
    if config is None:  # pragma: no cover - an unserializable custom config
        return f"{cls.__name__} state", None
    return f"{cls.__name__} state", _slots(cls, config)


def describe(inner) -> tuple[type, str | None]:
    """An inner optimizer's class and its config as sorted JSON (None when it does not serialize)."""
    try:
        return type(inner), json.dumps(inner.get_config(), sort_keys=True, default=str)
    except Exception:  # pragma: no cover - an unserializable custom config
        return type(inner), None
