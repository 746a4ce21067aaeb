"""Enforcement strategies for partially frozen variables.

Each strategy is a small object with two hooks around the inner optimizer's
update: ``prepare`` turns ``(gradient, variable)`` into what the inner
optimizer sees and keeps whatever ``finish`` needs; ``finish`` puts the model
variable right after the inner update.

- ``restore``: frozen-element gradients selected to 0 with ``where`` (never
  multiplied, so NaN/Inf cannot leak), inner update on the whole variable,
  then frozen elements written back from a snapshot taken in the same step.
  Persistent cost: the bool mask, one byte per element.
- ``compact``: the inner optimizer updates a flat vector holding only the
  trainable elements (gather, update, scatter back); frozen elements are
  never written and get no optimizer state.
- ``mask``: the folk recipe, gradient selection alone; not exact with weight
  decay, momentum, EMA and friends, and warned about.
- ``train``: a fully trainable variable, passed through (``lr_scale`` aside).

``lr_scale`` scales the step, not the gradient: the model variable is moved to
``old + scale * (new - old)`` after the inner update, so Adam-like optimizers
(invariant to gradient scale) and weight decay are scaled too. The scale lives
in an optimizer variable (a scalar, or one value per element when rules give
different scales inside one variable), so new values need no retrace.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Enforcer", "unravel", "write_all"]


def _tf():
    import tensorflow as tf

    return tf


def _tf_variable(v):
    """The ``tf.Variable`` behind a Keras variable (or the variable itself)."""
    tf = _tf()
    return v if isinstance(v, tf.Variable) else v.value


def _read(v):
    """A snapshot tensor of the variable's current value."""
    return _tf().identity(_tf_variable(v))


def _assign(var, value):
    return var.assign(value)


def _scatter(var, indices, values):
    return var.scatter_nd_update(indices, values)


def write_all(writes) -> None:
    """Perform ``[(variable, fn, args)]`` writes through the strategy's update path.

    Under ``tf.distribute`` a write from replica context goes through
    ``merge_call`` and ``extended.update``, which runs ``fn`` on every
    replica's copy with that replica's ``args``; a bare replica-context
    ``assign`` would aggregate the replicas' values (``aggregation="mean"``
    rounds them). Without a strategy this is a plain call of each ``fn``.
    """
    if not writes:
        return
    tf = _tf()
    tf_vars = [_tf_variable(v) for v, _, _ in writes]

    def merged(strategy, *all_args):
        for var, (_, fn, _), args in zip(tf_vars, writes, all_args):
            strategy.extended.update(var, fn, args=args, group=False)

    args = [a for _, _, a in writes]
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        tf.__internal__.distribute.interim.maybe_merge_call(merged, tf.distribute.get_strategy(), *args)
        return
    from finefreeze._distribute import owner_scope

    with owner_scope(tf_vars):  # e.g. finalize_variable_values after fit, outside the scope
        merged(tf.distribute.get_strategy(), *args)


def unravel(tf, flat, shape):
    """Flat indices to ``(k, ndim)`` indices, with ops XLA compiles.

    The arithmetic runs in the dtype of ``flat``: int64 indices (variables of
    2**31 elements or more) never wrap around.
    """
    if len(shape) <= 1:
        return tf.expand_dims(flat, 1)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    strides.reverse()
    return tf.stack([(flat // tf.cast(s, flat.dtype)) % tf.cast(d, flat.dtype) for s, d in zip(strides, shape)], axis=1)


@dataclasses.dataclass(eq=False)
class Enforcer:
    """The runtime side of one variable's layout entry: its optimizer variables and hooks.

    Kept in a plain container so model variables are never tracked by the optimizer.
    """

    path: str
    variable: Any  # model variable
    kind: str  # "train" | "restore" | "compact" | "mask"
    shape: tuple
    scale: Any = None  # float32 optimizer variable of lr_scale: () or per element; None = 1
    mask: Any = None  # bool optimizer variable (True = frozen): restore, mask
    index: Any = None  # int32/int64 optimizer variable of trainable flat indices: compact
    shadow: Any = None  # flat optimizer variable of trainable values: compact

    @property
    def inner_variable(self):
        return self.shadow if self.kind == "compact" else self.variable

    # -- hooks -------------------------------------------------------------
    def needs_snapshot(self) -> bool:
        return self.kind == "restore" or self.scale is not None

    def prepare(self, grad, writes: list):
        """Return ``(inner_grad, ctx)``; ``grad`` may be None (EMA steps).

        Writes the step needs before the inner update are appended to
        ``writes`` (see :func:`write_all`).
        """
        tf = _tf()
        if self.kind == "compact":
            idx = self.index.value
            values = tf.gather(tf.reshape(_read(self.variable), [-1]), idx)
            writes.append((self.shadow, _assign, (values,)))
            g = None
            if grad is not None:
                g = tf.gather(tf.reshape(tf.convert_to_tensor(grad), [-1]), idx)
            return g, (values if self.scale is not None else None)
        old = _read(self.variable) if self.needs_snapshot() else None
        if grad is None or self.kind == "train":
            return grad, old
        mask = self.mask.value
        if isinstance(grad, tf.IndexedSlices):
            rows = tf.gather(mask, grad.indices)
            vals = tf.where(rows, tf.zeros_like(grad.values), grad.values)
            return tf.IndexedSlices(vals, grad.indices, grad.dense_shape), old
        grad = tf.convert_to_tensor(grad)
        return tf.where(mask, tf.zeros_like(grad), grad), old

    def finish(self, old, writes: list):
        """Append the writes that put the model variable right after the inner update."""
        tf = _tf()
        if self.kind == "compact":
            new = self.shadow.value
            if old is not None:
                new = old + tf.cast(self.scale.value, new.dtype) * (new - old)
            writes.append((self.variable, _scatter, (unravel(tf, self.index.value, self.shape), new)))
            return
        if old is None:
            return
        cur = _read(self.variable)
        if self.scale is not None:
            cur = old + tf.cast(self.scale.value, cur.dtype) * (cur - old)
        if self.kind == "restore":
            cur = tf.where(self.mask.value, old, cur)
        writes.append((self.variable, _assign, (cur,)))
