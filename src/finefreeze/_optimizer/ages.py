"""Step counts from each element's release: a released element's update is a fresh optimizer's.

Keras optimizers count steps once (``iterations``), and Adam's, AdamW's,
Adamax's and Lamb's bias correction, Adafactor's decay and relative step,
and Muon's Adam path read that count in ``update_step``. An element
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
- per element (Adam, AdamW, Adamax, Lamb, Muon);
- per variable (Adafactor, whose factored moments are per row and column,
  and optimizers finefreeze does not know): one count per variable, from the
  release of its oldest trained elements;
- global (Nadam's ``u_product``, ScheduleFreeAdamW's averaging weights are
  one running product or sum per optimizer): Keras' global count.
"""

from __future__ import annotations

import contextlib

import numpy as np
from keras import ops

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.questions import keras_backend
from finefreeze._enforce.enforcer import elements
from finefreeze._enforce.policy import family
from finefreeze._kinds import Kind

__all__ = ["STEP_COUNTS", "counting", "fits", "held", "install", "kind_of", "recount", "recount_layout", "write"]

#: the ``step_count`` choices: from each element's release, or Keras' one count per optimizer
STEP_COUNTS = ("release", "global")
_STEP_FREE = {"SGD", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion"}
_PER_ELEMENT = {"Adam", "AdamW", "Adamax", "Lamb", "Muon"}
_GLOBAL = {"Nadam", "ScheduleFreeAdamW"}


def _kind_of_one(opt) -> str:
    names = [c.__name__ for c in type(opt).__mro__]
    for name in names:  # the most derived known class decides (a custom Adam is an Adam)
        if name in _GLOBAL:
            return "global"
        if name in _PER_ELEMENT:
            return "element"
        if name in _STEP_FREE:
            return "none"
    return "variable"


def kind_of(inner, step_count: str) -> str:
    """How ``inner`` counts released elements' steps: ``"none"``, ``"element"``, ``"variable"``.

    ``"none"`` also for ``step_count="global"`` and for optimizers whose
    step-dependent state is global (see the module docstring).
    """
    if step_count == "global":
        return "none"
    members = [o for o in family(inner) if not getattr(o, "_inner_optimizers", None)] or [inner]
    kinds = {_kind_of_one(o) for o in members}
    if "global" in kinds or kinds == {"none"}:
        return "none"
    return "variable" if "variable" in kinds else "element"


def _state_positions(e) -> tuple[np.ndarray, np.ndarray]:
    """``(elements, trained)``: the model elements behind ``e``'s state, in state order, and which train."""
    idx = elements(e, trained_only=False)
    if e.kind in (Kind.RESTORE, Kind.MASK):
        return idx, ~to_numpy(e.mask).reshape(-1).astype(bool)
    return idx, np.ones(idx.size, bool)


def held(e) -> np.ndarray | None:
    """The release step of each of ``e``'s trained elements (in sorted element order), or None (all 0)."""
    if e.born is None:
        return None
    idx, trained = _state_positions(e)
    born = to_numpy(e.born).astype(np.int64)
    values = np.broadcast_to(born.reshape(-1) if born.ndim else born, idx.shape)[trained]
    order = np.argsort(idx[trained], kind="stable")
    return values[order]


def _after(kind: str, step: int, idx, trained, old_elements, old_born):
    """The born values of a state over ``idx`` after a change: None (all 0), an int, or an array over ``idx``.

    Elements trained before keep their release step; the others are released now (``step``).
    """
    if kind == "none" or step == 0:
        return None
    new = idx[trained]
    if old_elements is not None and old_elements.size:
        pos = np.minimum(np.searchsorted(old_elements, new), old_elements.size - 1)
        kept = old_elements[pos] == new
        before = np.zeros(old_elements.size, np.int64) if old_born is None else old_born
        born = np.where(kept, before[pos], step)
    else:
        born = np.full(new.size, step, np.int64)
    if not born.size or not born.any():
        return None
    if kind == "variable":
        return int(born.min())
    if (born == born[0]).all():
        return int(born[0])
    full = np.full(idx.size, step, np.int64)  # a frozen element's value is never read
    full[trained] = born
    return full


def recount(opt, e, old: tuple | None):
    """``e``'s born values after a change; ``old`` is ``(elements, born)`` from before (see :func:`held`)."""
    idx, trained = _state_positions(e)
    step = int(to_numpy(opt.iterations))
    old_elements, old_born = old if old is not None else (None, None)
    return _after(opt._count_kind, step, idx, trained, old_elements, old_born)


def recount_layout(opt, layout_entry, e):
    """The born values ``e`` would hold once ``layout_entry`` (same kind, new mask) is in force."""
    size = int(np.prod(layout_entry.shape, dtype=np.int64))
    if layout_entry.kind == Kind.COMPACT:
        idx = layout_entry.mask.trainable_flat_indices()
        trained = np.ones(idx.size, bool)
    else:
        idx = np.arange(size)
        mask = layout_entry.mask
        trained = np.ones(size, bool) if mask is None else ~mask.dense().reshape(-1)
    step = int(to_numpy(opt.iterations))
    return _after(opt._count_kind, step, idx, trained, elements(e, trained_only=True), held(e))


def fits(e, value) -> bool:
    """Whether ``value`` (from :func:`recount`) can be written into ``e`` without a new optimizer variable."""
    if value is None:
        return True
    if e.born is None:
        return False
    return np.ndim(value) == 0 or tuple(e.born.shape) != ()


def write(opt, e, value) -> None:
    """Put ``value`` in ``e.born``: assigned where it fits, else a new optimizer variable (a rebuild)."""
    if value is None:
        if e.born is not None:
            e.born.assign(np.zeros(e.born.shape, np.int32))
        return
    array = np.asarray(value, np.int32)
    if array.ndim and e.kind != Kind.COMPACT:
        array = array.reshape(e.shape)  # one per element of the variable, else of the compact vector
    if e.born is not None and fits(e, value):
        e.born.assign(np.broadcast_to(array, e.born.shape))
        return
    layout = getattr(e.variable, "_layout", None) if array.shape == tuple(e.shape) and array.ndim else None
    e.born = opt.add_variable(
        shape=array.shape,
        dtype="int32",
        name=f"{e.path.replace('/', '.')}.born",
        initializer=lambda shape, dtype=None: array.reshape(shape),
        aggregation="none",
        layout=layout,
    )
    opt._enforcers.aged = None


def _aged(fo, o) -> dict:
    """``{o._var_key(inner variable): born}`` of the enforcers with a release step, cached per enforcer set."""
    enf = fo._enforcers
    cache = getattr(enf, "aged", None)
    if cache is None:
        cache = enf.aged = {}
    mine = cache.get(id(o))
    if mine is None:
        mine = cache[id(o)] = {o._var_key(e.inner_variable): e.born for e in enf.ordered if e.born is not None}
    return mine


@contextlib.contextmanager
def counting(o, born):
    """``o.iterations`` reads ``iterations - born`` inside the block."""
    total = o._iterations
    local = ops.subtract(total, ops.cast(born, total.dtype))
    object.__setattr__(o, "_iterations", local)
    try:
        yield
    finally:
        object.__setattr__(o, "_iterations", total)


def install(fo) -> None:
    """Make each inner optimizer of ``fo`` count a released variable's steps from its release (once per optimizer)."""
    if fo._count_kind == "none":
        return
    for o in family(fo.inner_optimizer):
        if "_finefreeze_counts" in vars(o):
            continue
        vars(o)["_finefreeze_counts"] = True
        _wrap_update_step(fo, o)
        if keras_backend() == "torch" and hasattr(o, "_parallel_update_step"):
            _wrap_parallel(fo, o)


def _wrap_update_step(fo, o) -> None:
    plain = o.update_step

    def update_step(gradient, variable, learning_rate):
        born = _aged(fo, o).get(o._var_key(variable))
        if born is None:
            return plain(gradient, variable, learning_rate)
        with counting(o, born.value):
            return plain(gradient, variable, learning_rate)

    vars(o)["update_step"] = update_step


def _wrap_parallel(fo, o) -> None:
    """PyTorch: variables grouped by a shared release step; one with several steps takes ``update_step``."""
    parallel = o._parallel_update_step
    per_variable = type(o).update_step

    def _parallel_update_step(grads, variables, learning_rate):
        aged = _aged(fo, o)
        if not aged:
            return parallel(grads, variables, learning_rate)
        groups: dict = {}
        for g, v in zip(grads, variables):
            born = aged.get(o._var_key(v))
            if born is not None and tuple(born.shape):
                with counting(o, born.value):
                    per_variable(o, g, v, learning_rate)
                continue
            key = None if born is None else int(to_numpy(born))
            gs, vs = groups.setdefault(key, ([], []))
            gs.append(g)
            vs.append(v)
        for key, (gs, vs) in groups.items():
            if key is None:
                parallel(gs, vs, learning_rate)
            else:
                with counting(o, np.asarray(key, np.int32)):
                    parallel(gs, vs, learning_rate)

    vars(o)["_parallel_update_step"] = _parallel_update_step
