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

from keras import ops

from finefreeze._backends.variables import assign, current, flat_dense, scatter_write, select_frozen_to_zero, snapshot
from finefreeze._kinds import Kind

__all__ = ["Enforcer"]


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
        return self.shadow if self.kind == Kind.COMPACT else self.variable

    # -- hooks -------------------------------------------------------------
    def needs_snapshot(self) -> bool:
        return self.kind == Kind.RESTORE or self.scale is not None

    def prepare(self, grad, writes: list):
        """Return ``(inner_grad, ctx)``; ``grad`` may be None (EMA steps).

        Writes the step needs before the inner update are appended to
        ``writes`` (see :func:`finefreeze._backends.variables.write_all`).
        """
        if self.kind == Kind.COMPACT:
            idx = self.index.value
            values = ops.take(ops.reshape(snapshot(self.variable), (-1,)), idx, axis=0)
            writes.append((self.shadow, assign, (values,)))
            g = None if grad is None else ops.take(flat_dense(grad), idx, axis=0)
            return g, (values if self.scale is not None else None)
        old = snapshot(self.variable) if self.needs_snapshot() else None
        if grad is None or self.kind == Kind.TRAIN:
            return grad, old
        return select_frozen_to_zero(self.mask.value, grad), old

    def finish(self, old, writes: list):
        """Append the writes that put the model variable right after the inner update."""
        if self.kind == Kind.COMPACT:
            new = self.shadow.value
            if old is not None:
                new = old + ops.cast(self.scale.value, ops.dtype(new)) * (new - old)
            writes.append(scatter_write(self.variable, self.index.value, new))
            return
        if old is None:
            return
        cur = current(self.variable)
        if self.scale is not None:
            cur = old + ops.cast(self.scale.value, ops.dtype(cur)) * (cur - old)
        if self.kind == Kind.RESTORE:
            cur = ops.where(self.mask.value, old, cur)
        writes.append((self.variable, assign, (cur,)))
