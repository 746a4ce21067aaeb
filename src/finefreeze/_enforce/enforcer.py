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

import keras
import numpy as np
from keras import ops

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.variables import (
    as_optimizers_see,
    assign,
    block_write,
    current,
    eager_scope,
    host_initializer,
    is_sparse,
    read_block,
    scatter_write,
    select_frozen_to_zero,
    snapshot,
    take_block,
    take_trainable,
    take_values,
)
from finefreeze._enforce.layout import VarLayout
from finefreeze._enforce.policy import family, index_dtype
from finefreeze._keras.instances import no_tracking
from finefreeze._keras.optimizers import decay_as
from finefreeze._keras.variables import distribution_layout
from finefreeze._kinds import Kind
from finefreeze._resolve.standins import kernel_of
from finefreeze._resolve.targets import remember_base
from finefreeze._slices.choose import sliced_gradient
from finefreeze._slices.product import spread

__all__ = [
    "Enforcer",
    "Enforcers",
    "decay_compact_like_its_variable",
    "delta_kernels",
    "elements",
    "make_enforcer",
    "make_enforcers",
    "scale_value",
    "with_delta_kernels",
]


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
    # flat variable of the trainable values (compact): an optimizer variable, or the stand-in a sliced layer
    # hands the trained elements' gradient to (a model variable, not the optimizer's)
    shadow: Any = None
    born: Any = None  # int32 optimizer variable: the step its elements were released at (see optimizer.ages)
    u_product: Any = None  # float32 optimizer variable beside born: Nadam's running product, per release
    block: Any = None  # compact: the trained elements as a block of ranges (slices), taken and written as one
    standin: Any = None  # the variable a sliced layer hands the trained elements' gradient to, or None
    owner: Any = None  # that layer
    trained: Any = None  # restore/mask with a stand-in: the flat indices of its elements (numpy), to scatter
    delta: bool = False  # compact of a quantized kernel: the stand-in is a float delta, the kernel never touched

    @property
    def inner_variable(self):
        return self.shadow if self.kind == Kind.COMPACT else self.variable

    def sliced_now(self) -> bool:
        """Whether the step being traced hands the trained elements' gradient to the stand-in (else: the kernel's).

        JAX gives a variable the step does not read a zero gradient, not
        None: which one carries the gradient is the layer's call's to say.
        """
        return self.standin is not None and sliced_gradient(self.owner, self.variable) is not None

    # -- hooks -------------------------------------------------------------
    def needs_snapshot(self) -> bool:
        return self.kind == Kind.RESTORE or self.scale is not None

    def prepare(self, grad, writes: list, standin_grad=None):
        """Return ``(inner_grad, ctx)``; ``grad`` may be None (EMA steps).

        ``standin_grad``: the gradient a sliced layer handed the stand-in
        (the trained elements only); then ``grad``, the model variable's, is
        None. Writes the step needs before the inner update are appended to
        ``writes`` (see :func:`finefreeze._backends.variables.write_all`).
        """
        if standin_grad is not None and self.kind != Kind.COMPACT:
            grad = spread(standin_grad, self.trained, self.shape)  # restore and mask hold dense state anyway
        if self.delta:  # the delta is the state: nothing to read from the integers
            return standin_grad, (snapshot(self.shadow) if self.scale is not None else None)
        if self.kind == Kind.COMPACT:
            idx = self.index.value
            if self.block is not None:  # the same elements in the same order, by slices
                values = read_block(self.variable, self.block, idx)
            else:
                values = take_values(self.variable, idx)  # the trainable elements only, not a copy of the variable
            writes.append((self.shadow, assign, (values,)))
            if standin_grad is not None:
                g = standin_grad
            elif grad is None:
                g = None
            elif self.block is not None and not is_sparse(grad):
                g = take_block(grad, self.block)
            else:
                g = take_trainable(grad, idx, self.shape)
            return g, (values if self.scale is not None else None)
        old = snapshot(self.variable) if self.needs_snapshot() else None
        if grad is None or self.kind == Kind.TRAIN:
            return grad, old
        return select_frozen_to_zero(self.mask.value, grad), old

    def finish(self, old, writes: list):
        """Append the writes that put the model variable right after the inner update."""
        if self.delta:
            if old is not None:
                new = self.shadow.value
                writes.append((self.shadow, assign, (old + ops.cast(self.scale.value, ops.dtype(new)) * (new - old),)))
            return
        if self.kind == Kind.COMPACT:
            new = self.shadow.value
            if old is not None:
                new = old + ops.cast(self.scale.value, ops.dtype(new)) * (new - old)
            if self.block is not None:
                writes.append(block_write(self.variable, self.block, new))
            else:
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


class Enforcers:
    """Plain container so model variables are never tracked by the optimizer."""

    def __init__(self, ordered=(), frozen_ids=(), state=None, norms: tuple = ()):
        self.ordered: list[Enforcer] = list(ordered)
        self.by_id: dict[int, Enforcer] = {id(e.variable): e for e in self.ordered}
        #: a stand-in's kernel's enforcer, by the stand-in's id
        self.by_standin: dict[int, Enforcer] = {id(e.standin): e for e in self.ordered if e.standin is not None}
        self.frozen_ids: set[int] = set(frozen_ids)
        self.norms: tuple = norms  # (trainable, frozen) gradient norms of the last step
        self.state = state  # the inner optimizer's state by variable (optimizer.migrate.StateMap)

    def own_variables(self) -> set[int]:
        return {
            id(w)
            for e in self.ordered
            for w in (e.mask, e.index, e.shadow, e.scale, e.born, e.u_product)
            if w is not None
        }


def make_enforcer(add_variable, v, e: VarLayout) -> Enforcer:
    """The enforcer of one trainable or partially frozen variable, with its optimizer variables.

    ``add_variable`` is the optimizer's: the enforcer's variables are the optimizer's own.
    """
    safe = e.path.replace("/", ".")
    enf = Enforcer(e.path, v, e.kind, e.shape)
    loaded = e.mask is None and e.enforced  # values arrive with the optimizer variables on load
    if e.kind == Kind.COMPACT:
        dtype = index_dtype(e.size)
        idx = np.full((e.n_trainable,), -1, dtype) if loaded else e.mask.trainable_flat_indices().astype(dtype)
        enf.index = add_variable(
            shape=idx.shape, dtype=dtype, name=f"{safe}.index", initializer=host_initializer(idx), aggregation="none"
        )
        # Starts as the trainable values (optimizers may read it in build) and
        # is refilled from the model variable at every step (gather).
        enf.shadow = e.standin
        if enf.shadow is None:
            enf.shadow = add_variable(
                shape=idx.shape,
                dtype=v.dtype,
                name=f"{safe}.compact",
                initializer=host_initializer(0 if loaded else _eager_values(v, idx)),
                aggregation="none",
            )
        enf.block = None if loaded else e.block
    elif e.kind in (Kind.RESTORE, Kind.MASK):
        dense = np.ones(e.shape, bool) if loaded else e.mask.dense()
        if e.standin is not None:
            enf.trained = np.flatnonzero(~dense.reshape(-1))
        enf.mask = add_variable(
            shape=e.shape,
            dtype="bool",
            name=f"{safe}.frozen_mask",
            initializer=host_initializer(dense),
            aggregation="none",
            layout=distribution_layout(v),  # sharded like the variable (keras.distribution)
        )
    scale = scale_value(e, enf)
    if scale is not None:
        enf.scale = add_variable(
            shape=scale.shape,
            dtype="float32",
            name=f"{safe}.lr_scale",
            initializer=host_initializer(scale),
            aggregation="none",
            # one scale per element: sharded like the variable; a scalar: replicated
            layout=distribution_layout(v) if scale.shape == tuple(e.shape) and scale.ndim else None,
        )
    enf.standin, enf.owner, enf.delta = e.standin, e.owner, e.delta
    return enf


def elements(e: Enforcer, trained_only: bool) -> np.ndarray:
    """Flat indices of the model elements behind an enforcer's per-element state, in state order."""
    if e.kind == Kind.COMPACT:
        return to_numpy(e.index).astype(np.int64)
    idx = np.arange(int(np.prod(e.shape, dtype=np.int64)))
    if trained_only and e.mask is not None:
        idx = idx[~to_numpy(e.mask).reshape(-1)]
    return idx


def scale_value(e: VarLayout, enf: Enforcer) -> np.ndarray | None:
    """The lr_scale values an enforcer holds: None (all 1), a scalar, or one per inner element."""
    if not e.per_element_scale:
        return None if e.scale == 1.0 else np.asarray(e.scale, np.float32)
    if enf.kind == Kind.COMPACT:
        if e.mask is None:
            return np.ones((e.n_trainable,), np.float32)
        return e.scale.reshape(-1)[e.mask.trainable_flat_indices()].astype(np.float32)
    return e.scale.astype(np.float32)


def _eager_values(variable, idx: np.ndarray) -> np.ndarray:
    """The variable's elements at flat ``idx``, read eagerly even while a train function is traced."""
    with eager_scope():
        return np.asarray(keras.ops.convert_to_numpy(variable)).reshape(-1)[idx]


@no_tracking
def make_enforcers(add_variable, layout, var_list, saved: bool) -> tuple[list[Enforcer], set[int]]:
    """The enforcers of every variable of ``var_list`` that trains at all, and the ids of the frozen ones.

    ``saved``: the layout came from a file. Made without Keras' dependency
    tracking: the optimizer must never track model variables.
    """
    ordered, frozen, seen = [], set(), set(layout.standins())  # stand-ins: their kernels' enforcers
    for v in with_delta_kernels(layout, var_list):
        if id(v) in seen:
            continue
        seen.add(id(v))
        e = layout.get(v)
        if e.kind == Kind.FROZEN:
            frozen.add(id(v))
            if saved and getattr(v, "trainable", False):
                remember_base(v)  # Keras trains it; the plan freezes it
                v.trainable = False  # per-variable flags are not saved in .keras files
            continue
        ordered.append(make_enforcer(add_variable, v, e))
    return ordered, frozen


def _missing_kernels(var_list, kernel_of_delta) -> list:
    """The quantized kernels whose deltas are in ``var_list`` (``kernel_of_delta(v)``: None for others) and they not."""
    given, out = {id(v) for v in var_list}, []
    for v in var_list:
        kernel = kernel_of_delta(v)
        if kernel is not None and id(kernel) not in given:
            given.add(id(kernel))
            out.append(kernel)
    return out


def with_delta_kernels(layout, var_list) -> list:
    """``var_list`` and the quantized kernels whose deltas are in it (Keras trains the delta, not the integers)."""
    deltas = {k for k, e in layout.standins().items() if e.delta}
    return list(var_list) + _missing_kernels(var_list, lambda v: kernel_of(v) if id(v) in deltas else None)


def delta_kernels(enforcers: Enforcers, var_list) -> list:
    """The quantized kernels whose deltas are in ``var_list`` and which are not (Keras trains the delta only)."""

    def kernel(v):
        e = enforcers.by_standin.get(id(v))
        return e.variable if e is not None and e.delta else None

    return _missing_kernels(var_list, kernel)


def decay_compact_like_its_variable(inner, enforcers: Enforcers) -> None:
    """A compact vector gets weight decay exactly when its model variable would.

    Keras decides per variable (``_use_weight_decay``: excluded ids, then
    name patterns) and caches the answer by variable key; the vector's
    entry is set to the model variable's answer, so neither an anchored
    pattern (``"^kernel$"``) nor one that happens to match the vector's
    own name changes the maths.
    """
    for o in family(inner):
        for e in enforcers.ordered:
            if e.kind == Kind.COMPACT:
                decay_as(o, as_optimizers_see(e.shadow), as_optimizers_see(e.variable))
