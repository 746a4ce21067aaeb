"""``FreezingOptimizer``: a Keras optimizer that enforces a plan exactly.

Built the way Keras' ``LossScaleOptimizer`` wraps an optimizer: it holds an
``inner_optimizer`` for life (never cloned or replaced), delegates
``learning_rate`` and ``iterations``, refuses base-optimizer arguments (they
belong to the inner optimizer), its ``variables`` are its own plus the inner
ones, and ``get_config`` serializes the inner optimizer with the layout. Its
own ``apply`` is where freezing happens: fully frozen variables never reach
the inner optimizer; partially frozen ones go through their enforcer's
``prepare`` / ``finish`` hooks around the inner update.
"""

from __future__ import annotations

import weakref

import keras

from finefreeze._backends.distribute import check_cross_replica, check_optimizer
from finefreeze._backends.variables import build_scope, own_buffers, write_all
from finefreeze._enforce.enforcer import delta_kernels
from finefreeze._enforce.layout import Layout
from finefreeze._enforce.policy import refuse_nan, warn_inexact_mask
from finefreeze._errors import PlanError
from finefreeze._keras.optimizers import built_on
from finefreeze._kinds import Kind
from finefreeze._optimizer import ages, checkpoint, in_force, norms
from finefreeze._optimizer.arguments import SettingsGoInside, refuse_arguments
from finefreeze._optimizer.enforcement import Enforcement
from finefreeze._plan.plan import Plan

__all__ = ["FreezingOptimizer", "find_freezing_optimizer"]


@keras.saving.register_keras_serializable(package="finefreeze")
class FreezingOptimizer(SettingsGoInside, keras.optimizers.Optimizer):
    """A Keras optimizer that keeps a plan's frozen elements bit-identical.

    Fully frozen variables get no gradient work and no optimizer state;
    partially frozen ones use a strategy: ``"restore"`` (exact for every
    optimizer, dense state), ``"compact"`` (exact, state only for trainable
    elements; only for optimizers whose update is elementwise), ``"mask"``
    (gradient masking alone, inexact, warned) or ``"auto"`` (compact when at
    most 5 % of a variable trains and the optimizer is elementwise, else
    restore). Optimizer settings (``weight_decay``, ``clipnorm``,
    ``use_ema``, ...) belong to the inner optimizer, as with Keras'
    ``LossScaleOptimizer``.

    Args:
        inner_optimizer: any unbuilt ``keras.optimizers.Optimizer`` except a
            ``LossScaleOptimizer`` (that one must stay outermost; Keras adds
            it itself under ``mixed_float16``).
        plan: a :class:`Plan`. Resolved against the variables the optimizer
            is built on; prefer ``Freezer.wrap``, which also knows layers.
        strategy: ``"auto"``, ``"restore"``, ``"compact"`` or ``"mask"``.
        step_count: ``"release"`` (a released element counts steps from its release) or ``"global"``.
        name: optimizer name.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras optimizer or is a
            ``LossScaleOptimizer``, or a base-optimizer argument was given.
        ValueError: ``inner_optimizer`` is already built.
        PlanError: unknown strategy or step count.

    Example:
        >>> import keras, finefreeze as ff
        >>> opt = ff.FreezingOptimizer(keras.optimizers.Adam(1e-3), ff.Plan([ff.freeze("x[0]")]))
        >>> opt.strategy
        'auto'
        >>> ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan(), clipnorm=1.0)
        Traceback (most recent call last):
        ...
        TypeError: FreezingOptimizer takes no optimizer settings (got clipnorm); they belong to the inner optimizer: ...
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        plan: Plan | None = None,
        *,
        strategy: str = "auto",
        step_count: str = "release",
        name: str | None = None,
        **kwargs,
    ):
        refuse_arguments(FreezingOptimizer, inner_optimizer, plan, strategy, kwargs, step_count)
        super().__init__(learning_rate=0.0, name=name or "freezing_optimizer")
        self.inner_optimizer = inner_optimizer
        self._plan = plan
        self._step_count = step_count
        self._count_kind = ages.kind_of(inner_optimizer, step_count)
        self._enforcement = Enforcement(self, inner_optimizer, strategy, self._count_kind)
        #: what a loaded model's Freezer saved of its gradients (``Freezer._gradients_record()``), or None
        self._saved_gradients = None
        self._freezer_ref = None
        self._freezer_strong = None
        #: FreezeBoard sets it: each step writes the gradient norms (it reads the gradients, changes none)
        self._track_gradient_norms = False
        self._norms_recorded = False

    def _start_from(self, resolution=None, layout=None, saved_layout=None, saved_gradients=None) -> FreezingOptimizer:
        """Start from a layout decided already (``Freezer.wrap``) or a saved config's (``from_config``)."""
        self._enforcement = Enforcement(
            self, self.inner_optimizer, self.strategy, self._count_kind, resolution, layout, saved_layout
        )
        self._saved_gradients = saved_gradients
        return self

    @property
    def strategy(self) -> str:
        """The strategy requested (``auto`` picks per variable)."""
        return self._enforcement.strategy

    @property
    def plan(self) -> Plan | None:
        """The plan this optimizer enforces."""
        return self._plan

    @property
    def _layout(self) -> Layout | None:
        """The per-variable :class:`~finefreeze._enforce.layout.Layout` it enforces (None before it knows its variables)."""
        return self._enforcement.layout

    @property
    def _placeholders(self) -> bool:
        """Built from a saved layout, no values loaded yet (a model saved before its first step)."""
        return self._enforcement.placeholders

    @property
    def variables(self):
        own = super().variables + self.inner_optimizer.variables
        if getattr(self, "_track_gradient_norms", False) and self._enforcement.enforcers.norms:
            # while tracked, the norms are training state: Keras' JAX trainer carries only
            # the optimizer's variables through its jitted step (never saved: see below)
            own = own + list(self._enforcement.enforcers.norms)
        return own

    def _stored_variables(self) -> list:
        """The variables as saved: each stand-in where ``compact``'s vector is (``checkpoint.stored``)."""
        return checkpoint.stored(self)

    def save_own_variables(self, store):
        checkpoint.save(self, store)

    def load_own_variables(self, store):
        """Load the saved state; a checkpoint written under another plan puts that plan in force first.

        Raises:
            PlanError: the checkpoint's masks do not resolve against this
                optimizer's model, or its record is of another format.
        """
        checkpoint.load_into(self, self._enforcement, store, self._freezer)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Exclude model variables from the inner optimizer's weight decay (also under ``compact``)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    @property
    def _enforcers(self) -> tuple:
        """The enforcers of the variables it updates, in build order (empty before ``build``)."""
        return tuple(self._enforcement.enforcers.ordered)

    def _adopt_resolution(self, resolution) -> None:
        """Take ``resolution`` as the one its layout came from (the Freezer rebuilt for a loaded model)."""
        self._enforcement.adopt_resolution(resolution)

    @property
    def _freezer(self):
        """The :class:`Freezer` of this optimizer (made by ``wrap`` or ``Freezer.of``), or None."""
        return self._freezer_ref() if self._freezer_ref is not None else None

    def _bind_freezer(self, freezer, strong: bool = False) -> None:
        """Make ``freezer`` its Freezer: weakly, or strongly for one rebuilt for a loaded model."""
        self._freezer_ref = weakref.ref(freezer)
        self._freezer_strong = freezer if strong else None

    def _record_norms(self, on: bool) -> bool:
        """Whether each step records the gradient norms from now on (a retrace puts it in force); returns the old setting.

        Recording reads the gradients the step computes anyway and changes none of them.
        """
        was, self._track_gradient_norms = self._track_gradient_norms, on
        return was

    def _gradient_norms(self) -> tuple[float, float] | None:
        """``(trainable, frozen)`` norms of the gradient of the last step, before enforcement.

        Recorded while ``_track_gradient_norms`` is True (``FreezeBoard`` sets
        it). "Frozen": the gradient on frozen elements of partially frozen
        variables, what the plan blocked. Returns None before a tracked step.
        """
        got = self._enforcement.enforcers.norms
        if not got or not self._norms_recorded:
            return None
        return norms.read(got)

    # -- building ------------------------------------------------------------
    def build(self, var_list):
        if self.built:
            return

        check_optimizer(self, var_list, "FreezingOptimizer.build")
        check_cross_replica(var_list)
        state = self._enforcement
        in_force.check_at_build(state, var_list, self._freezer)
        layout = state.layout_for(var_list, self._plan)
        self._warn(layout)
        with build_scope():  # not constants of the first step's traced graph (TensorFlow)
            state.install(layout, var_list)
            # built on what it updates: a loaded model's optimizer is built on every variable and
            # takes the frozen ones out (Keras' JAX trainer pairs this list with the model's)
            super().build([v for v in var_list if id(v) not in state.enforcers.frozen_ids])

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        # Keras' JAX trainer: the list it was built on
        in_force.check_stateless(built_on(self) if self.built else None, trainable_variables, self._freezer)
        return super().stateless_apply(optimizer_variables, grads, trainable_variables)

    def _warn(self, layout: Layout) -> None:
        """Refuse a layout the inner optimizer would turn into NaN; warn about inexact ``mask``."""
        self._refuse_nan(layout)
        if not self._enforcement.warned("mask") and warn_inexact_mask(self.inner_optimizer, layout):
            self._enforcement.first_time("mask")

    def _refuse_nan(self, layout: Layout) -> None:
        """Refuse (``PlanError``) a layout the inner optimizer would turn into NaN (``policy.refuse_nan``)."""
        refuse_nan(self.inner_optimizer, layout)

    # -- changing the plan -------------------------------------------------------
    def _prepare_change(self, resolution, var_list) -> Layout:
        """The layout a new resolution gives; raises (changing nothing) if it cannot be enforced.

        Raises:
            PlanError: ``var_list`` holds a variable the resolution does not know, or
                the strategy cannot serve the inner optimizer.
        """
        layout = Layout.from_resolution(resolution, self.strategy, self.inner_optimizer, var_list)
        self._warn(layout)
        return layout

    def _commit_change(self, resolution, layout: Layout, var_list) -> bool:
        """Put ``layout`` in force (``Freezer.update``, after :meth:`_prepare_change`); True: retrace the step.

        Mask and ``lr_scale`` changes are written into the optimizer's
        variables; anything else rebuilds the same inner optimizer in place,
        keeping the state of every element that stays trainable (``Enforcement.commit``).
        """
        self._plan = resolution.plan
        return self._enforcement.commit(resolution, layout, var_list, self.built)

    def _begin_change(self):
        """What :meth:`_undo_change` needs to undo a :meth:`_commit_change`."""
        return self._enforcement.begin()

    @staticmethod
    def _undo_change(undo) -> None:
        """Undo a :meth:`_commit_change`: attributes, variable lists and values as they were."""
        Enforcement.undo(undo)

    # -- applying ------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError("FreezingOptimizer.apply(grads) without variables needs a built optimizer: pass them.")
            trainable_variables = built_on(self)
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} variables.")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        state, frz = self._enforcement, self._freezer
        enf = state.enforcers
        in_force.warn_unbound(state, self._saved_gradients, frz)
        if trainable_variables is not built_on(self):
            in_force.warn_not_in_force(state, trainable_variables, frz)
        all_steps = bool(getattr(self.inner_optimizer, "use_ema", False))
        inner_g, inner_v, pending, seen, writes, raw = [], [], [], set(), [], []
        # a sliced layer hands its trained elements' gradient to their stand-in, and none to the kernel
        to_standins = {
            id(enf.by_standin[id(v)]): g for g, v in zip(grads, trainable_variables) if id(v) in enf.by_standin
        }
        # a quantized kernel is not Keras' to train: its delta (a stand-in) is; the kernel's enforcer applies it
        for g, v in [*zip(grads, trainable_variables), *((None, k) for k in delta_kernels(enf, trainable_variables))]:
            if id(v) in enf.frozen_ids or id(v) in enf.by_standin:
                continue
            e = enf.by_id.get(id(v))
            if e is None:
                if in_force.plan_freezes(state, v):  # handed in by another plan's flags: frozen here
                    continue
                raise in_force.not_built_on(state, v)
            standin_g = to_standins.get(id(e)) if e.sliced_now() else None
            if g is None and standin_g is None and not all_steps:
                continue
            seen.add(id(v))
            raw.append((e, g, standin_g))
            ig, ctx = e.prepare(g, writes, standin_g)
            if ig is not None:
                inner_g.append(ig)
                inner_v.append(e.inner_variable)
            if e.kind != Kind.TRAIN or ctx is not None:
                pending.append((e, ctx))
        if all_steps:
            for e in enf.ordered:
                if e.kind in (Kind.RESTORE, Kind.COMPACT) and id(e.variable) not in seen:
                    pending.append((e, e.prepare(None, writes)[1]))
        write_all(writes)
        if self._track_gradient_norms:
            self._norms_recorded = True
            norms.record(enf.norms, raw)
        if inner_g:
            self.inner_optimizer.apply(inner_g, inner_v)
        else:
            self.inner_optimizer.iterations.assign_add(1)
        writes = []
        for e, ctx in pending:
            e.finish(ctx, writes)
        write_all(writes, after=grads)

    def _trains_outside(self, var_list=None) -> list[str]:
        """Paths its plan trains that are not in ``var_list`` (default: what it is built on)."""
        return in_force.trains_outside(self._enforcement, built_on(self) if var_list is None else var_list)

    def finalize_variable_values(self, var_list):
        if not self.built or not getattr(self.inner_optimizer, "use_ema", False):
            return
        writes = []
        pending = [
            (e, e.prepare(None, writes)[1])
            for e in self._enforcement.enforcers.ordered
            if e.kind in (Kind.RESTORE, Kind.COMPACT)
        ]
        write_all(writes)
        self.inner_optimizer.finalize_variable_values(built_on(self.inner_optimizer))
        writes = []
        for e, ctx in pending:
            e.finish(ctx, writes)
        write_all(writes)
        own_buffers(built_on(self.inner_optimizer))

    # -- serialization -------------------------------------------------------
    def get_config(self):
        plan = None
        if self._plan is not None:
            try:
                plan = self._plan.to_dict()
            except PlanError:
                plan = None
        state = self._enforcement
        layout = state.layout.to_config() if state.layout is not None else state.saved_layout
        frz = self._freezer
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "plan": plan,
            "strategy": self.strategy,
            "step_count": self._step_count,
            "layout": layout,
            "gradients": self._saved_gradients if frz is None else frz._gradients_record(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        plan = config.pop("plan", None)
        opt = cls(
            inner,
            Plan.from_dict(plan) if plan else None,
            strategy=config.pop("strategy", "auto"),
            step_count=config.pop("step_count", "release"),
            name=config.pop("name", None),
        )
        return opt._start_from(saved_layout=config.pop("layout", None), saved_gradients=config.pop("gradients", None))


def find_freezing_optimizer(model) -> FreezingOptimizer | None:
    """The FreezingOptimizer compiled into ``model``, looking through wrappers such as LossScaleOptimizer."""
    opt = getattr(model, "optimizer", None)
    while opt is not None and not isinstance(opt, FreezingOptimizer):
        opt = getattr(opt, "inner_optimizer", None)
    return opt
