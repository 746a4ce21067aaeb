"""Step counts from each element's release: a released element's update is a fresh optimizer's.

Keras optimizers count steps once (``iterations``), and Adam's, AdamW's,
Adamax's and Lamb's bias correction, Nadam's momentum schedule,
ScheduleFreeAdamW's warmup and averaging, Adafactor's decay and relative
step, and Muon's Adam path read that count in ``update_step``. An element
released at step ``s`` (by ``Freezer.update``, ``GradualUnfreezing`` or
``Reselect``) starts with zero moments; with the global count its first
update would be bias-corrected as step ``s + 1``, several times the first
step of a fresh optimizer.

So an enforcer whose trained elements were not all trained from the first
step holds ``born``: the step each element was released at, an int32 scalar
when they share it, else one value per element of its state. For the
duration of that variable's update (``update_step``; on PyTorch the grouped
``_parallel_update_step``) the inner optimizer's count reads
``iterations - born``: per element on TensorFlow and JAX, and on PyTorch
where a variable's elements share their count (whole released variables);
elements of one variable released at different steps take Keras'
per-variable ``update_step`` on PyTorch (the same maths, without the fused
``torch._foreach`` order). Learning-rate schedules keep the global step.
Nothing is held, and nothing swapped, while every element trains from the
first step, or for an optimizer without a step count.

Kinds of inner optimizers (by class, sub-classes included):

- step-free (SGD, RMSprop, Adagrad, Adadelta, Ftrl, Lion): nothing to count;
- per element (Adam, AdamW, Adamax, Lamb, Muon, ScheduleFreeAdamW, and
  Nadam, whose running product ``u_product`` is then kept per release too,
  in ``u_product`` beside ``born``);
- per variable (Adafactor, whose factored moments are per row and column,
  and optimizers finefreeze does not know): one count per variable, from the
  release of its oldest trained elements.
"""

from __future__ import annotations

import contextlib

import numpy as np
from keras import ops

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.chosen import chosen
from finefreeze._backends.variables import host_initializer
from finefreeze._enforce.enforcer import elements
from finefreeze._enforce.policy import family
from finefreeze._keras.optimizers import (
    counting_from,
    fused_update_step,
    iterations_variable,
    nadam_product,
    replace_fused_update_step,
    replace_update_step,
    sub_optimizers,
    var_key,
)
from finefreeze._keras.variables import distribution_layout
from finefreeze._kinds import Kind

__all__ = [
    "STEP_COUNTS",
    "aged",
    "counting",
    "fits",
    "held",
    "install",
    "kind_of",
    "recount",
    "recount_layout",
    "write",
]

#: the ``step_count`` choices: from each element's release, or Keras' one count per optimizer
STEP_COUNTS = ("release", "global")
_STEP_FREE = {"SGD", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion"}
_PER_ELEMENT = {"Adam", "AdamW", "Adamax", "Lamb", "Muon", "Nadam", "ScheduleFreeAdamW"}


def _kind_of_one(opt) -> str:
    names = [c.__name__ for c in type(opt).__mro__]
    for name in names:  # the most derived known class decides (a custom Adam is an Adam)
        if name in _PER_ELEMENT:
            return "element"
        if name in _STEP_FREE:
            return "none"
    return "variable"


def kind_of(inner, step_count: str) -> str:
    """How ``inner`` counts released elements' steps: ``"none"``, ``"element"``, ``"variable"``.

    ``"none"`` also for ``step_count="global"``.
    """
    if step_count == "global":
        return "none"
    members = [o for o in family(inner) if not sub_optimizers(o)] or [inner]
    kinds = {_kind_of_one(o) for o in members}
    if kinds == {"none"}:
        return "none"
    return "variable" if "variable" in kinds else "element"


def _state_positions(e) -> tuple[np.ndarray, np.ndarray]:
    """``(elements, trained)``: the model elements behind ``e``'s state, in state order, and which train."""
    idx = elements(e, trained_only=False)
    if e.kind in (Kind.RESTORE, Kind.MASK):
        return idx, ~to_numpy(e.mask).reshape(-1).astype(bool)
    return idx, np.ones(idx.size, bool)


def _product(state):
    """The inner optimizer's running product of Nadam's momentum schedule (``u_product``), or None."""
    return next((p for o in family(state.inner) if (p := nadam_product(o)) is not None), None)


def held(e) -> tuple | None:
    """``(release step, Nadam's product or None)`` of ``e``'s trained elements in sorted element order; None: all 0."""
    if e.born is None:
        return None
    idx, trained = _state_positions(e)
    order = np.argsort(idx[trained], kind="stable")

    def per_element(w, dtype):
        a = to_numpy(w).astype(dtype)
        return np.broadcast_to(a.reshape(-1) if a.ndim else a, idx.shape)[trained][order]

    product = None if e.u_product is None else per_element(e.u_product, np.float64)
    return per_element(e.born, np.int64), product


def _after(kind: str, step: int, idx, trained, old_elements, old, product):
    """``(born, product)`` of a state over ``idx`` after a change: None (all 0), scalars, or arrays over ``idx``.

    Elements trained before keep their release step (and Nadam's product);
    the others are released now (``step``, a product of 1). ``product`` is
    the optimizer's own (for elements trained from the first step), or None.
    """
    if kind == "none" or step == 0:
        return None
    new = idx[trained]
    n_old = 0 if old_elements is None else old_elements.size
    if n_old:
        pos = np.minimum(np.searchsorted(old_elements, new), n_old - 1)
        kept = old_elements[pos] == new
    else:
        pos, kept = np.zeros(new.size, np.int64), np.zeros(new.size, bool)
    old_born, old_product = old if old is not None else (np.zeros(n_old, np.int64), None)
    born = np.where(kept, old_born[pos] if n_old else 0, step)
    if not born.size or not born.any():
        return None
    prod = None
    if product is not None:  # elements trained from the first step share the optimizer's own product
        was = np.full(n_old, product, np.float64) if old_product is None else old_product
        prod = np.where(kept, was[pos] if n_old else 1.0, 1.0)
    if kind == "variable":
        first = int(np.argmin(born))
        return int(born[first]), None if prod is None else float(prod[first])
    if (born == born[0]).all():
        return int(born[0]), None if prod is None else float(prod[0])
    full = np.full(idx.size, step, np.int64)  # a frozen element's value is never read
    full[trained] = born
    if prod is not None:
        prod_full = np.ones(idx.size, np.float64)
        prod_full[trained] = prod
        prod = prod_full
    return full, prod


def _own_product(state):
    product = _product(state)
    return None if product is None else float(to_numpy(product))


def recount(state, e, old: tuple | None):
    """``e``'s ``(born, product)`` after a change; ``old`` is ``(elements, held)`` from before (see :func:`held`)."""
    idx, trained = _state_positions(e)
    old_elements, before = old if old is not None else (None, None)
    return _after(state.count_kind, state.step(), idx, trained, old_elements, before, _own_product(state))


def recount_layout(state, layout_entry, e):
    """The ``(born, product)`` ``e`` would hold once ``layout_entry`` (same kind, new mask) is in force."""
    size = int(np.prod(layout_entry.shape, dtype=np.int64))
    if layout_entry.kind == Kind.COMPACT:
        idx = layout_entry.mask.trainable_flat_indices()
        trained = np.ones(idx.size, bool)
    else:
        idx = np.arange(size)
        mask = layout_entry.mask
        trained = np.ones(size, bool) if mask is None else ~mask.dense().reshape(-1)
    old = elements(e, trained_only=True), held(e)
    return _after(state.count_kind, state.step(), idx, trained, *old, _own_product(state))


def fits(e, value) -> bool:
    """Whether ``value`` (from :func:`recount`) can be written into ``e`` without a new optimizer variable."""
    if value is None:
        return True
    if e.born is None:
        return False
    return np.ndim(value[0]) == 0 or tuple(e.born.shape) != ()


def _variable(state, e, name: str, array: np.ndarray):
    layout = distribution_layout(e.variable) if array.shape == tuple(e.shape) and array.ndim else None
    return state.add_variable(
        shape=array.shape,
        dtype=str(array.dtype),
        name=f"{e.path.replace('/', '.')}.{name}",
        initializer=host_initializer(array),
        aggregation="none",
        layout=layout,
    )


def write(state, e, value) -> tuple | None:
    """Put ``value`` (``(born, product)``) in ``e``'s variables where it fits; else the new variables that hold it.

    Returns:
        None when written, else ``(born, product or None)``: new optimizer
        variables for ``e`` (its owner, ``Enforcement``, puts them in).
    """
    if value is None:
        if e.born is not None:
            e.born.assign(np.zeros(e.born.shape, np.int32))
            if e.u_product is not None:
                e.u_product.assign(np.full(e.u_product.shape, _own_product(state), np.float32))
        return None
    born, product = (np.asarray(v) if v is not None else None for v in value)
    born = born.astype(np.int32)
    if born.ndim and e.kind != Kind.COMPACT:  # one per element of the variable, else of the compact vector
        born = born.reshape(e.shape)
        product = None if product is None else product.reshape(e.shape)
    if e.born is not None and fits(e, value):
        e.born.assign(np.broadcast_to(born, e.born.shape))
        if e.u_product is not None and product is not None:
            e.u_product.assign(np.broadcast_to(product.astype(np.float32), e.u_product.shape))
        return None
    made = None if product is None else _variable(state, e, "u_product", product.astype(np.float32))
    return _variable(state, e, "born", born), made


def aged(enforcers, o) -> dict:
    """``{var_key(o, inner variable): enforcer}`` of the enforcers with a release step."""
    return {var_key(o, e.inner_variable): e for e in enforcers.ordered if e.born is not None}


@contextlib.contextmanager
def counting(o, born, product=None, advance: bool = True):
    """``o.iterations`` reads ``iterations - born`` inside the block (and Nadam's ``u_product`` reads ``product``).

    ``advance``: first move ``product`` on by this step's factor, as Nadam's
    ``_backend_update_step`` moves its own (PyTorch's fused Nadam does it itself).
    """
    total = iterations_variable(o)
    local = ops.subtract(total, ops.cast(born, total.dtype))
    own = nadam_product(o)
    if product is not None and own is not None and advance:
        factor = 1.0 - 0.5 * ops.power(0.96, ops.cast(local + 1, own.dtype))
        o.assign(product, chosen().nadam_product_step(product, o.beta_1, factor))
    with counting_from(o, local, product if own is not None else None):
        yield


def install(state) -> None:
    """Make each inner optimizer count a released variable's steps from its release (once per optimizer)."""
    if state.count_kind == "none":
        return
    for o in family(state.inner):
        if not replace_update_step(o, lambda plain, o=o: _update_step(state, o, plain)):
            continue
        fused = fused_update_step(o)
        if fused is not None:
            replace_fused_update_step(o, _parallel(state, o, fused))


def _update_step(state, o, plain):
    def update_step(gradient, variable, learning_rate):
        e = state.aged(o).get(var_key(o, variable))
        if e is None:
            return plain(gradient, variable, learning_rate)
        with counting(o, e.born.value, e.u_product):
            return plain(gradient, variable, learning_rate)

    return update_step


def _parallel(state, o, parallel):
    """PyTorch: variables grouped by a shared release step; one with several steps takes ``update_step``."""
    per_variable = type(o).update_step

    def parallel_update_step(grads, variables, learning_rate):
        aged = state.aged(o)
        if not aged:
            return parallel(grads, variables, learning_rate)
        groups: dict = {}
        for g, v in zip(grads, variables):
            e = aged.get(var_key(o, v))
            if e is not None and tuple(e.born.shape):
                with counting(o, e.born.value, e.u_product):
                    per_variable(o, g, v, learning_rate)
                continue
            # one group per release step; with Nadam's product one per variable (the fused step writes it)
            key = None if e is None else (int(to_numpy(e.born)), id(e) if e.u_product is not None else 0)
            gs, vs, _ = groups.setdefault(key, ([], [], e))
            gs.append(g)
            vs.append(v)
        for key, (gs, vs, e) in groups.items():
            if key is None:
                parallel(gs, vs, learning_rate)
            else:
                with counting(o, e.born.value, e.u_product, advance=False):
                    parallel(gs, vs, learning_rate)

    return parallel_update_step
