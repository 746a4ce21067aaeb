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

__all__ = ["optimizer_state"]

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
        be measured. Before any ``wrap``: ``("state (Adam)", 2)``.

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> w = keras.Variable(np.zeros((3,), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
        >>> optimizer_state(frz)
        ('state (Adam)', 2)
        >>> _ = frz.wrap(keras.optimizers.SGD(0.1, momentum=0.9))
        >>> optimizer_state(frz)
        ('SGD state', 1)
    """
    opts = frz.optimizers()
    if not opts:
        return "state (Adam)", 2
    inner = opts[-1].inner_optimizer
    try:
        config = json.dumps(inner.get_config(), sort_keys=True, default=str)
    except Exception:  # pragma: no cover - an unserializable custom config
        return f"{type(inner).__name__} state", None
    return f"{type(inner).__name__} state", _slots(type(inner), config)
