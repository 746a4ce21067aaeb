"""``Enforcement``: the state a ``FreezingOptimizer`` enforces its plan with, owned by one object.

A ``FreezingOptimizer`` holds one :class:`Enforcement` for life. It owns
the enforcers (and their optimizer variables), the layout they follow, the
resolution that layout came from, how released elements count their steps,
and the inner optimizer's build on the enforcers' variables; these stay in
step because only its methods change them:

- :meth:`Enforcement.layout_for` and :meth:`Enforcement.install`: the first
  build;
- :meth:`Enforcement.commit`: a plan change, written in place when only
  masks, indices or scales change (no retrace), else a rebuild of the same
  inner optimizer carrying each element's state (``migrate``);
- :meth:`Enforcement.begin` / :meth:`Enforcement.undo`: the transaction of a
  change that fails further on (``Freezer.update``);
- :meth:`Enforcement.load_ages`: a checkpoint's release steps.

The wrapper delegates to it; ``ages``, ``in_force`` and ``checkpoint`` read
it through its public properties and change it only through its methods.
"""

from __future__ import annotations

import keras
import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._enforce.enforcer import (
    Enforcer,
    Enforcers,
    decay_compact_like_its_variable,
    elements,
    make_enforcers,
    scale_value,
)
from finefreeze._enforce.layout import Layout, check_saved, refuse_unknown
from finefreeze._enforce.policy import family
from finefreeze._keras.instances import attributes, restore_attributes
from finefreeze._keras.optimizers import forget_positions, own_variables
from finefreeze._kinds import Kind
from finefreeze._optimizer import ages, migrate, norms
from finefreeze._plan.plan import Plan
from finefreeze._resolve.resolve import resolve
from finefreeze._resolve.targets import collect

__all__ = ["Enforcement"]


class Enforcement:
    """The enforcers, layout, resolution, step counts and inner build of one ``FreezingOptimizer``.

    Args:
        optimizer: the ``FreezingOptimizer`` (its ``add_variable`` makes the
            enforcers' variables; its name scopes them).
        inner: its inner optimizer, built here on what the enforcers hand it.
        strategy: the strategy requested (``"auto"``, ``"restore"``, ...).
        count_kind: how released elements count steps (``ages.kind_of``).
        resolution: the resolution the layout comes from, when known.
        layout: a layout decided already (``Freezer.wrap``), or None.
        saved_layout: the layout of a saved optimizer's config, or None.

    Raises:
        PlanError: ``saved_layout`` is of another format (``check_saved``).

    Example:
        >>> import keras, finefreeze as ff
        >>> opt = ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan())
        >>> opt._layout is None  # nothing enforced before build
        True
    """

    def __init__(
        self, optimizer, inner, strategy: str, count_kind: str, resolution=None, layout=None, saved_layout=None
    ):
        self._optimizer = optimizer
        self._inner = inner
        self._strategy = strategy
        self._count_kind = count_kind
        self._resolution = resolution
        self._layout: Layout | None = layout
        if saved_layout is not None:
            check_saved(saved_layout)  # refused as the model file is read, before anything is built on it
        self._saved_layout = saved_layout
        self._inner_base = migrate.constructor_variables(inner)
        self._enforcers = Enforcers(state=migrate.StateMap({}, {}, []))
        self._warned: set[str] = set()
        self._checked = None  # the variable list last checked for the plan in force (ids)
        self._aged: dict | None = None  # {id(inner optimizer): {variable key: enforcer}} of those with release steps
        self._placeholders = False  # built from a saved layout: masks and indices wait for the file's values

    # -- what it holds (read-only) ----------------------------------------------
    @property
    def enforcers(self) -> Enforcers:
        """The enforcers in force (empty before the first build)."""
        return self._enforcers

    @property
    def layout(self) -> Layout | None:
        """The layout in force, or None before it knows its variables."""
        return self._layout

    @property
    def placeholders(self) -> bool:
        """Whether the enforcers hold placeholders: built from a saved layout, no values loaded or written since."""
        return self._placeholders

    def values_loaded(self) -> None:
        """The enforcers hold the values of a file (``load_own_variables``)."""
        self._placeholders = False

    @property
    def saved_layout(self):
        """The layout a saved config held (a loaded optimizer), or None."""
        return self._saved_layout

    @property
    def resolution(self):
        """The resolution the layout came from, or None."""
        return self._resolution

    @property
    def strategy(self) -> str:
        """The strategy requested (``auto`` picks per variable)."""
        return self._strategy

    @property
    def count_kind(self) -> str:
        """``"none"``, ``"element"`` or ``"variable"``: how released elements count steps."""
        return self._count_kind

    @property
    def inner(self):
        """The inner optimizer."""
        return self._inner

    def step(self) -> int:
        """The optimizer's step count now."""
        return int(to_numpy(self._optimizer.iterations))

    def add_variable(self, **kwargs):
        """A new variable of the optimizer (``add_variable``'s arguments), for an enforcer."""
        return self._optimizer.add_variable(**kwargs)

    # -- one-time notices ----------------------------------------------------------
    def first_time(self, notice: str) -> bool:
        """True the first time ``notice`` is asked about (a warning given once per optimizer)."""
        if notice in self._warned:
            return False
        self._warned.add(notice)
        return True

    def warned(self, notice: str) -> bool:
        """Whether ``notice`` was given already (see :meth:`first_time`)."""
        return notice in self._warned

    def newly_checked(self, var_list) -> bool:
        """Whether ``var_list`` differs from the list checked last (PyTorch hands the same list every step)."""
        key = tuple(id(v) for v in var_list)
        if key == self._checked:
            return False
        self._checked = key
        return True

    # -- building ----------------------------------------------------------------
    def adopt_resolution(self, resolution) -> None:
        """Take ``resolution`` as the one the layout came from (a Freezer rebuilt for a loaded model)."""
        self._resolution = resolution

    def layout_for(self, var_list, plan: Plan | None) -> Layout:
        """The layout to build on ``var_list``: the one decided, the saved one, or ``plan``'s resolved on it.

        Raises:
            PlanError: ``var_list`` holds a variable the resolution does not know.
        """
        if self._layout is not None:
            refuse_unknown(self._resolution, var_list)
            return self._layout
        if self._saved_layout is not None:
            return Layout.from_config(self._saved_layout, var_list, self._strategy)
        if self._resolution is None:
            self._resolution = resolve(plan or Plan(), collect(list(var_list)))
        return Layout.from_resolution(self._resolution, self._strategy, self._inner, var_list)

    def install(self, layout: Layout, var_list, held: dict | None = None, others: dict | None = None) -> None:
        """Put ``layout`` in force: its enforcers, the inner optimizer built on them, ``held`` state carried.

        ``held`` (``{id(variable): migrate.Held}``) and ``others`` (global
        state by key) come from a plan change; a first build starts as
        Keras does.
        """
        opt = self._optimizer
        ordered, frozen = make_enforcers(opt.add_variable, layout, var_list, saved=self._saved_layout is not None)
        recorded = norms.variables()  # optimizer variables only while FreezeBoard tracks them
        # outside the no-tracking scope: the inner optimizer tracks what it makes
        # (Nadam's u_product is an attribute, not an add_variable)
        state = migrate.build_recording(self._inner, [e.inner_variable for e in ordered])
        enforcers = Enforcers(ordered, frozen, state, recorded)
        decay_compact_like_its_variable(self._inner, enforcers)
        self._layout, self._enforcers, self._aged = layout, enforcers, None
        self._placeholders = held is None and self._saved_layout is not None
        ages.install(self)
        if held is not None:
            _put_back(enforcers.state, others or {})
            for e in enforcers.ordered:
                self._carry(e, held.get(id(e.variable)))

    # -- changing the plan -------------------------------------------------------
    def commit(self, resolution, layout: Layout, var_list, built: bool) -> bool:
        """Put ``layout`` (of ``resolution``) in force; True when the train function must be retraced.

        Mask, index and ``lr_scale`` changes of enforcers that keep their kind
        and shape are written in place; anything else rebuilds.
        """
        fresh = self._placeholders  # nothing trained or loaded: no state to carry
        self._resolution, self._placeholders = resolution, False
        if not built or self._in_place(layout, var_list, fresh):
            self._layout = layout
            return False
        self._rebuild(layout, var_list, fresh)
        return True

    def begin(self):
        """What :meth:`undo` needs to put the optimizer back as it is now."""
        opt = self._optimizer
        members = [opt, *family(self._inner)]
        dicts = [(o, attributes(o), list(own_variables(o))) for o in members]
        ours = self._enforcers.own_variables()
        masks = [(w, to_numpy(w).copy()) for w in own_variables(opt) if id(w) in ours]
        state = [(w, to_numpy(w).copy()) for ws in self._enforcers.state.per_element.values() for _, w, _ in ws]
        mine = dict(vars(self), _warned=set(self._warned))
        return self, mine, dicts, masks + state

    @staticmethod
    def undo(saved) -> None:
        """Undo a change: the optimizers' attributes, variable lists and values as :meth:`begin` saw them."""
        self, mine, dicts, values = saved
        vars(self).clear()
        vars(self).update(mine, _aged=None)
        for o, d, lst in dicts:
            restore_attributes(o, d)
            migrate.retrack(o, lst)
        for w, value in values:
            w.assign(value)

    def _in_place(self, layout: Layout, var_list, fresh: bool = False) -> bool:
        """Write mask, index and scale changes into place; False (nothing written) when an enforcer changes."""
        old = self._enforcers
        todo = []
        for v in {id(v): v for v in list(var_list) + [e.variable for e in old.ordered]}.values():
            e = layout.get(v)
            if e is None or e.kind == Kind.FROZEN:
                if id(v) in old.by_id:
                    return False
                continue
            enf = old.by_id.get(id(v))
            if enf is None or not _same_shape(enf, e) or not ages.fits(enf, ages.recount_layout(self, e, enf)):
                return False  # another kind, size, block, stand-in or scale; or a first release into it
            todo.append((enf, e, scale_value(e, enf)))
        for enf, e, scale in todo:
            if enf.kind in (Kind.RESTORE, Kind.MASK) and not np.array_equal(to_numpy(enf.mask), e.mask.dense()):
                kept = None if fresh else self._held(enf)
                enf.mask.assign(e.mask.dense())
                self._carry(enf, kept)
            elif enf.kind == Kind.COMPACT and not np.array_equal(to_numpy(enf.index), e.mask.trainable_flat_indices()):
                kept = None if fresh else self._held(enf)
                enf.index.assign(e.mask.trainable_flat_indices().astype(enf.index.dtype))
                self._carry(enf, kept)
            if scale is not None:
                enf.scale.assign(scale)
        return True

    def _rebuild(self, layout: Layout, var_list, fresh: bool = False) -> None:
        """New enforcers around the same inner optimizer, rebuilt in place; state carried by element (``fresh``: none)."""
        opt = self._optimizer
        kept = {} if fresh else {id(e.variable): self._held(e) for e in self._enforcers.ordered}
        others = {k: to_numpy(w) for k, w in migrate.keyed(self._enforcers.state.other).items()}
        ours = self._enforcers.own_variables()
        migrate.untrack(opt, [w for w in own_variables(opt) if id(w) in ours])
        migrate.unbuild(self._inner, self._inner_base)
        with keras.name_scope(opt.name, caller=opt):
            self.install(layout, var_list, kept, others)
        forget_positions(opt)
        keras.optimizers.Optimizer.build(opt, list(var_list))

    def _carry(self, e: Enforcer, held) -> None:
        """Fresh state for elements that start training, ``held`` state for those that keep training."""
        idx = elements(e, trained_only=False)
        values = to_numpy(e.variable).reshape(-1)[idx]
        migrate.carry(self._enforcers.state, e.inner_variable, idx, values, held)
        self._write_ages(e, ages.recount(self, e, None if held is None else (held.elements, held.born)))

    def _held(self, e: Enforcer) -> migrate.Held:
        """The state of ``e``'s trained elements now."""
        idx = elements(e, trained_only=True)
        got = migrate.snapshot(self._enforcers.state, e.inner_variable, idx, e.kind == Kind.COMPACT)
        got.born = ages.held(e)
        return got

    # -- release steps -------------------------------------------------------------
    def aged(self, o) -> dict:
        """``{key of o: enforcer}`` of the enforcers holding release steps, for inner optimizer ``o`` (cached)."""
        if self._aged is None:
            self._aged = {}
        if id(o) not in self._aged:
            self._aged[id(o)] = ages.aged(self._enforcers, o)
        return self._aged[id(o)]

    def _write_ages(self, e: Enforcer, value) -> None:
        """Give ``e`` the release steps ``value`` (``ages.write``), in new optimizer variables where they do not fit."""
        made = ages.write(self, e, value)
        if made is not None:
            e.born = made[0]
            e.u_product = made[1] if made[1] is not None else e.u_product
            self._aged = None  # an enforcer gained release-step variables

    def load_ages(self, saved: list, store) -> None:
        """Give each enforcer the release steps a checkpoint holds for it: ``saved`` is ``[(slot, path, slot)]``."""
        enforcers = list(self._enforcers.ordered)
        migrate.untrack(self._optimizer, [w for e in enforcers for w in (e.born, e.u_product) if w is not None])
        for e in enforcers:
            e.born = e.u_product = None
        for i, path, j in saved:
            e = _same_path(path, enforcers)
            if e is not None:
                self._write_ages(e, (np.asarray(store[str(i)]), None if j is None else np.asarray(store[str(j)])))
        self._aged = None


def _same_shape(enf: Enforcer, e) -> bool:
    """Whether ``enf`` can take layout entry ``e`` by assignments: same kind, size, block, stand-in and scale."""
    if enf.kind != e.kind or (e.kind == Kind.COMPACT and enf.index.shape[0] != e.n_trainable):
        return False
    if e.kind == Kind.COMPACT and enf.block != e.block:
        return False  # a sliced kernel's step takes its trained block by slices: rebuilt (and retraced)
    if enf.standin is not e.standin:
        return False  # the layer hands the gradient to another stand-in (or to none): rebuilt on it
    scale = scale_value(e, enf)
    if (scale is None) != (enf.scale is None):
        return False
    return scale is None or tuple(scale.shape) == tuple(enf.scale.shape)


def _put_back(state, others: dict) -> None:
    """Global state of the inner optimizer as it was before a rebuild (Nadam's u_product, ...)."""
    for k, w in migrate.keyed(state.other).items():
        if k in others:
            w.assign(others[k])


def _same_path(path: str, enforcers):
    """The enforcer of ``path``; a model loaded on its own names its variables without the outer model's name."""
    exact = [e for e in enforcers if e.path == path]
    if exact:
        return exact[0]
    near = [e for e in enforcers if path.endswith("/" + e.path) or e.path.endswith("/" + path)]
    return near[0] if len(near) == 1 else None
