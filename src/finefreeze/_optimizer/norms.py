"""The gradient norms FreezeBoard shows: of the trainable part and of the part the plan blocked.

A ``FreezingOptimizer`` holds two scalar variables (:func:`variables`); while
its ``_track_gradient_norms`` is on (FreezeBoard turns it on) every step
writes them (:func:`record`), and ``gradient_norms()`` reads them
(:func:`read`). They are optimizer variables only while tracked, never saved.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from finefreeze._backends.variables import assign, flat_dense, write_all
from finefreeze._kinds import Kind

__all__ = ["read", "record", "variables"]


def variables() -> tuple:
    """The two norm variables, ``(trainable, frozen)``."""
    return tuple(
        keras.Variable(0.0, dtype="float32", trainable=False, name=n, aggregation="only_first_replica")
        for n in ("grad_norm_trainable", "grad_norm_frozen")
    )


def read(norms) -> tuple[float, float]:
    """The values of the norm variables."""
    return tuple(float(np.asarray(keras.ops.convert_to_numpy(v))) for v in norms)


def record(norms, raw) -> None:
    """Write the norms of the raw gradient on trainable and on frozen elements into ``norms``.

    ``raw``: ``(enforcer, gradient, stand-in's gradient)`` per variable; a
    stand-in's gradient is of trained elements only (a sliced layer computes
    none for frozen ones).
    """
    tn, fn = ops.zeros(()), ops.zeros(())
    for e, g, standin_g in raw:
        if standin_g is not None:
            tn += ops.sum(ops.square(ops.cast(flat_dense(standin_g), "float32")))
            continue
        if g is None:
            continue
        g = ops.cast(flat_dense(g), "float32")
        if e.kind == Kind.TRAIN:
            tn += ops.sum(ops.square(g))
            continue
        if e.kind == Kind.COMPACT:  # each part summed from its own elements: a difference of sums would round
            idx = e.index.value
            trained = ops.sum(ops.square(ops.take(g, idx, axis=0)))
            frozen = ops.scatter_update(g, ops.expand_dims(idx, 1), ops.zeros(ops.shape(idx), g.dtype))
        else:
            frozen_mask = ops.reshape(e.mask.value, (-1,))
            trained = ops.sum(ops.square(ops.where(frozen_mask, ops.zeros_like(g), g)))
            frozen = ops.where(frozen_mask, g, ops.zeros_like(g))
        tn += trained
        fn += ops.sum(ops.square(frozen))
    write_all([(norms[0], assign, (ops.sqrt(tn),)), (norms[1], assign, (ops.sqrt(fn),))])
