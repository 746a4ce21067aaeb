"""The plan-change transaction of a ``FreezingOptimizer``: in place when it can, else rebuilt; undoable.

``Freezer.update`` runs it: :func:`begin` saves what :func:`undo` restores;
then the optimizer's ``commit_change`` writes mask, index and ``lr_scale``
changes into its variables (:func:`in_place`, no retrace) or rebuilds the
enforcers around the same inner optimizer (:func:`rebuild`), carrying each
element's state (:func:`held`, :func:`carry`; see ``migrate``).
"""

from __future__ import annotations

import keras
import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._enforce.enforcer import Enforcer, elements, scale_value
from finefreeze._enforce.layout import Layout
from finefreeze._enforce.policy import family
from finefreeze._kinds import Kind
from finefreeze._optimizer import ages, migrate

__all__ = ["begin", "carry", "held", "in_place", "put_back", "rebuild", "undo"]


def carry(opt, e: Enforcer, held) -> None:
    """Fresh state for elements that start training, ``held`` state for those that keep training."""
    idx = elements(e, trained_only=False)
    values = to_numpy(e.variable).reshape(-1)[idx]
    migrate.carry(opt._enforcers.state, e.inner_variable, idx, values, held)
    ages.write(opt, e, ages.recount(opt, e, None if held is None else (held.elements, held.born)))


def held(opt, e: Enforcer) -> migrate.Held:
    """The state of ``e``'s trained elements now."""
    got = migrate.snapshot(
        opt._enforcers.state, e.inner_variable, elements(e, trained_only=True), e.kind == Kind.COMPACT
    )
    got.born = ages.held(e)
    return got


def in_place(opt, layout: Layout, var_list) -> bool:
    """Write mask, index and scale changes into place; False (nothing written) when an enforcer changes shape or kind."""
    old = opt._enforcers
    todo = []
    for v in {id(v): v for v in list(var_list) + [e.variable for e in old.ordered]}.values():
        e = layout.get(v)
        if e is None or e.kind == Kind.FROZEN:
            if id(v) in old.by_id:
                return False
            continue
        enf = old.by_id.get(id(v))
        if enf is None or enf.kind != e.kind or (e.kind == Kind.COMPACT and enf.index.shape[0] != e.n_trainable):
            return False
        if e.kind == Kind.COMPACT and enf.block != e.block:
            return False  # a sliced kernel's step takes its trained block by slices: rebuilt (and retraced)
        if enf.standin is not e.standin:
            return False  # the layer hands the gradient to another stand-in (or to none): rebuilt on it
        scale = scale_value(e, enf)
        if (scale is None) != (enf.scale is None) or (
            scale is not None and tuple(scale.shape) != tuple(enf.scale.shape)
        ):
            return False
        if not ages.fits(enf, ages.recount_layout(opt, e, enf)):
            return False  # a first release into it needs a new optimizer variable
        todo.append((enf, e, scale))
    for enf, e, scale in todo:
        if enf.kind in (Kind.RESTORE, Kind.MASK) and not np.array_equal(to_numpy(enf.mask), e.mask.dense()):
            kept = held(opt, enf)
            enf.mask.assign(e.mask.dense())
            carry(opt, enf, kept)
        elif enf.kind == Kind.COMPACT and not np.array_equal(to_numpy(enf.index), e.mask.trainable_flat_indices()):
            kept = held(opt, enf)
            enf.index.assign(e.mask.trainable_flat_indices().astype(enf.index.dtype))
            carry(opt, enf, kept)
        if scale is not None:
            enf.scale.assign(scale)
    return True


def rebuild(opt, layout: Layout, var_list) -> None:
    """New enforcers around the same inner optimizer, rebuilt in place; state carried by element."""
    kept = {id(e.variable): held(opt, e) for e in opt._enforcers.ordered}
    others = {k: to_numpy(w) for k, w in migrate.keyed(opt._enforcers.state.other).items()}
    ours = opt._enforcers.own_variables()
    migrate.untrack(opt, [w for w in opt._variables if id(w) in ours])
    migrate.unbuild(opt.inner_optimizer, opt._inner_base)
    opt._layout = layout
    with keras.name_scope(opt.name, caller=opt):
        opt._install(layout, var_list, kept, others)
    opt._trainable_variables_indices = {}
    keras.optimizers.Optimizer.build(opt, list(var_list))


def put_back(state, others: dict) -> None:
    """Global state of the inner optimizer as it was before a rebuild (Nadam's u_product, ...)."""
    for k, w in migrate.keyed(state.other).items():
        if k in others:
            w.assign(others[k])


def begin(opt):
    """What :func:`undo` needs to put ``opt`` back as it is now."""
    members = [opt, *family(opt.inner_optimizer)]
    dicts = [(o, dict(vars(o)), list(o._variables)) for o in members]
    masks = [(w, to_numpy(w).copy()) for w in opt._variables if id(w) in opt._enforcers.own_variables()]
    state = [(w, to_numpy(w).copy()) for ws in opt._enforcers.state.per_element.values() for _, w, _ in ws]
    return dicts, masks + state


def undo(saved) -> None:
    """Undo a change: attributes, variable lists and values as :func:`begin` saw them."""
    dicts, values = saved
    for o, d, lst in dicts:
        vars(o).clear()
        vars(o).update(d)
        migrate.retrack(o, lst)
    for w, value in values:
        w.assign(value)
