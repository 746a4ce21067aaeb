"""``FreezingOptimizer``: a Keras optimizer that enforces a plan exactly.

Built the way Keras' ``LossScaleOptimizer`` wraps an optimizer: it holds an
``inner_optimizer``, delegates ``learning_rate`` and ``iterations``, its
``variables`` are its own plus the inner ones, and ``get_config`` serializes
the inner optimizer. Its own ``apply`` is where freezing happens: fully frozen
variables never reach the inner optimizer; partially frozen ones go through
their strategy's ``prepare`` / ``finish`` hooks around the inner update.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import keras
import numpy as np

from finefreeze._errors import DistributionError, FreezeWarning, PlanError
from finefreeze._plan import Plan
from finefreeze._resolve import FROZEN, PARTIAL, TRAINABLE, UNTRAINED
from finefreeze._strategies import STRATEGIES, Slot, _assign, choose, write_all
from finefreeze._targets import match_path, var_path

__all__ = ["FreezingOptimizer", "inexact_reasons", "find_freezing_optimizer", "freezer_of"]

from keras.src.utils.tracking import no_automatic_dependency_tracking as _no_tracking


def inexact_reasons(opt) -> list[str]:
    """Why gradient masking alone would move frozen elements under ``opt``."""
    reasons = []
    if getattr(opt, "weight_decay", None):
        reasons.append(f"weight_decay={opt.weight_decay}")
    if getattr(opt, "use_ema", False):
        reasons.append("use_ema=True")
    name = type(opt).__name__
    if name == "SGD":
        if getattr(opt, "momentum", 0.0):
            reasons.append(f"momentum={opt.momentum}")
    elif name == "RMSprop":
        if getattr(opt, "momentum", 0.0):
            reasons.append(f"momentum={opt.momentum}")
    elif name not in ("Adagrad", "Adadelta"):
        reasons.append(f"{name} keeps moving elements whose gradient is 0 (momentum or its own state)")
    return reasons


@dataclasses.dataclass(eq=False)
class _Decision:
    """How the plan treats one variable the optimizer is built on."""

    variable: Any
    state: str  # TRAINABLE, PARTIAL or FROZEN
    mask: Any = None  # ElementMask, or a saved layout entry (dict)
    n_trainable: int | None = None
    scale: Any = 1.0  # float, or a per-element float32 array


class _Slots:
    """Plain container so model variables are never tracked by the optimizer."""

    def __init__(self):
        self.by_id: dict[int, Slot] = {}
        self.frozen_ids: set[int] = set()
        self.ordered: list[Slot] = []
        self.norms: tuple = ()  # (trainable, frozen) gradient norms of the last step


@keras.saving.register_keras_serializable(package="finefreeze")
class FreezingOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer that keeps a plan's frozen elements bit-identical.

    Fully frozen variables get no gradient work and no optimizer state;
    partially frozen ones use a strategy: ``"restore"`` (exact for every
    optimizer, dense state), ``"compact"`` (exact, state only for trainable
    elements), ``"mask"`` (gradient masking alone, inexact, warned) or
    ``"auto"`` (compact when at most 5 % of a variable trains, else
    restore).

    Args:
        inner_optimizer: any ``keras.optimizers.Optimizer`` except a
            ``LossScaleOptimizer`` (that one must stay outermost; Keras adds
            it itself under ``mixed_float16``).
        plan: a :class:`Plan`. Resolved against the variables the optimizer
            is built on; prefer ``Freezer.wrap``, which also knows layers.
        strategy: ``"auto"``, ``"restore"``, ``"compact"`` or ``"mask"``.
        name: optimizer name.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras optimizer or is a
            ``LossScaleOptimizer``.
        PlanError: unknown strategy.

    Example:
        >>> import keras, finefreeze as ff
        >>> opt = ff.FreezingOptimizer(keras.optimizers.Adam(1e-3), ff.Plan([ff.freeze("x[0]")]))
        >>> opt.strategy
        'auto'
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        plan: Plan | None = None,
        *,
        strategy: str = "auto",
        name: str | None = None,
        _resolution: Any = None,
        _layout: dict | None = None,
        **kwargs,
    ):
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError(
                "FreezingOptimizer cannot wrap a LossScaleOptimizer: the loss scale "
                "optimizer must stay outermost. Wrap the plain optimizer; under "
                "mixed_float16, model.compile adds the LossScaleOptimizer around "
                "the FreezingOptimizer itself (or wrap it yourself: "
                "LossScaleOptimizer(FreezingOptimizer(Adam(), plan)))."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"inner_optimizer must be a keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}."
            )
        if strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
        if plan is not None and not isinstance(plan, Plan):
            raise PlanError(f"plan must be an ff.Plan, got {type(plan).__name__}.")
        kwargs.pop("learning_rate", None)
        super().__init__(learning_rate=0.0, name=name or "freezing_optimizer", **kwargs)
        self.inner_optimizer = inner_optimizer
        self._plan = plan
        self._strategy = strategy
        self._resolution = _resolution
        self._layout = _layout
        self._slots = _Slots()
        self._mask_warned = False
        self._freezer_ref = None
        self.track_gradient_norms = False

    # -- delegation ----------------------------------------------------------
    @property
    def strategy(self) -> str:
        """The strategy requested (``auto`` picks per variable)."""
        return self._strategy

    @property
    def plan(self) -> Plan | None:
        """The plan this optimizer enforces."""
        return self._plan

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

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

    @property
    def freezer(self):
        """The :class:`Freezer` that made this optimizer with ``wrap``, or None."""
        return self._freezer_ref() if self._freezer_ref is not None else None

    def gradient_norms(self) -> tuple[float, float] | None:
        """``(trainable, frozen)`` norms of the gradient the last step applied.

        Recorded only while ``track_gradient_norms`` is True (``FreezeBoard``
        turns it on). "Frozen" is the gradient that reached frozen elements
        of partially frozen variables after enforcement: 0 under every
        strategy; a frozen element can still move under ``mask`` (weight
        decay, momentum), which ``Freezer.verify`` catches.

        Returns:
            The two norms, or None before the first tracked step.
        """
        if not self._slots.norms:
            return None
        return tuple(float(np.asarray(keras.ops.convert_to_numpy(v))) for v in self._slots.norms)

    # -- building ------------------------------------------------------------
    def _decisions(self, var_list) -> list[_Decision]:
        """One decision per variable: the plan's, or the saved layout's."""
        if self._layout is not None:
            return self._decisions_from_layout(var_list)
        res = self._resolution
        if res is None:
            from finefreeze._resolve import resolve
            from finefreeze._targets import collect

            res = resolve(self._plan or Plan(), collect(list(var_list)))
            self._resolution = res
        out, seen = [], set()
        listed = list(var_list) + [s.variable for s in res.states]
        for v in listed:
            if id(v) in seen:
                continue
            seen.add(id(v))
            st = res.lookup(v)
            if st is None:
                out.append(_Decision(v, TRAINABLE))
            elif st.state in (FROZEN, UNTRAINED):
                out.append(_Decision(v, FROZEN))
            else:
                scale = st.lr_scales if st.lr_scales is not None else st.lr_scale
                out.append(_Decision(v, st.state, st.mask, st.n_trainable, scale))
        return out

    def _decisions_from_layout(self, var_list) -> list[_Decision]:
        entries = {e["path"]: e for e in self._layout["variables"]}
        entries.update({p: {"path": p, "strategy": "frozen"} for p in self._layout["frozen"]})
        out = []
        for v in var_list:
            e = match_path(var_path(v), entries, "variable (in the saved freeze layout)")
            if e is None:
                out.append(_Decision(v, TRAINABLE))
            elif e["strategy"] == "frozen":
                out.append(_Decision(v, FROZEN))
                if getattr(v, "trainable", False) and isinstance(v, keras.Variable):
                    v.trainable = False  # per-variable flags are not saved in .keras files
            else:
                state = TRAINABLE if e["strategy"] == "train" else PARTIAL
                scale = e.get("lr_scale", 1.0)
                if scale == "per-element":  # values arrive with the optimizer variables on load
                    scale = np.ones([int(d) for d in v.shape], np.float32)
                out.append(_Decision(v, state, e, e.get("n_trainable"), scale))
        return out

    def _kind(self, variable, n_trainable: int) -> str:
        """The concrete strategy of one partially frozen variable."""
        size = int(np.prod(variable.shape, dtype=np.int64))
        kind = choose(self._strategy, n_trainable, size, getattr(variable, "constraint", None) is not None)
        if kind == "compact" and isinstance(self.inner_optimizer, keras.optimizers.MultiOptimizer):
            return "restore"  # MultiOptimizer routes by the model variable's path
        return kind

    def _kind_of(self, d: _Decision) -> str:
        if d.state == TRAINABLE:
            return "train"
        if d.state == FROZEN:
            return "frozen"
        return d.mask["strategy"] if isinstance(d.mask, dict) else self._kind(d.variable, d.n_trainable)

    def _layout_for(self, decisions) -> dict:
        """What the config records so that a loaded optimizer builds the same slots."""
        entries, frozen = [], []
        for d in decisions:
            path, shape, kind = var_path(d.variable), [int(x) for x in d.variable.shape], self._kind_of(d)
            scale = "per-element" if isinstance(d.scale, np.ndarray) else float(d.scale)
            if kind == "frozen":
                frozen.append(path)
            elif kind != "train":
                entry = {"path": path, "strategy": kind, "shape": shape, "n_trainable": int(d.n_trainable)}
                entries.append({**entry, "lr_scale": scale})
            elif scale != 1.0:
                entries.append({"path": path, "strategy": "train", "shape": shape, "lr_scale": scale})
        return {"variables": entries, "frozen": sorted(frozen)}

    def build(self, var_list):
        if self.built:
            return
        import tensorflow as tf

        from finefreeze._distribute import check_optimizer, owner_strategy

        check_optimizer(self, var_list, "FreezingOptimizer.build")
        if owner_strategy(var_list) is not None and not tf.distribute.in_cross_replica_context():
            raise DistributionError(
                "FreezingOptimizer is being built inside strategy.run: build it in the strategy's "
                "scope first (model.compile + fit do; in a custom loop call "
                "opt.build(frz.trainable_variables) inside `with strategy.scope():`)."
            )
        self._build_slots(self._decisions(var_list))
        super().build(var_list)

    def _build_slots(self, decisions):
        self._make_slots(decisions)
        # outside the no-tracking scope: the inner optimizer tracks what it makes
        # (Nadam's u_product is an attribute, not an add_variable)
        self.inner_optimizer.build([s.inner_variable for s in self._slots.ordered])

    @_no_tracking
    def _make_slots(self, decisions):
        if self._layout is None:
            self._layout = self._layout_for(decisions)
        slots = _Slots()
        for d in decisions:
            kind = self._kind_of(d)
            if kind == "frozen":
                slots.frozen_ids.add(id(d.variable))
                continue
            slot = self._make_slot(d, kind)
            slots.by_id[id(d.variable)] = slot
            slots.ordered.append(slot)
        import tensorflow as tf

        slots.norms = tuple(
            tf.Variable(0.0, trainable=False, name=n, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for n in ("grad_norm_trainable", "grad_norm_frozen")
        )
        self._slots = slots
        if any(s.kind == "mask" for s in slots.ordered):
            self._warn_mask()

    def _make_slot(self, d: _Decision, kind: str) -> Slot:
        """The Slot of one trainable or partially frozen variable, with its optimizer variables."""
        v, path = d.variable, var_path(d.variable)
        shape = tuple(int(x) for x in v.shape)
        safe = path.replace("/", ".")
        from_layout = isinstance(d.mask, dict)  # values arrive on load
        slot = Slot(path, v, kind, shape)
        if kind == "compact":
            idx = (
                np.full((d.n_trainable,), -1, np.int32)
                if from_layout
                else d.mask.trainable_flat_indices().astype(np.int32)
            )
            slot.index = self.add_variable(
                shape=idx.shape, dtype="int32", name=f"{safe}.index", initializer=_const(idx), aggregation="none"
            )
            # Refilled from the model variable at every step (gather).
            slot.shadow = self.add_variable(
                shape=idx.shape, dtype=v.dtype, name=f"{safe}.compact", initializer="zeros", aggregation="none"
            )
        elif kind in ("restore", "mask"):
            dense = np.ones(shape, bool) if from_layout else d.mask.dense()
            slot.mask = self.add_variable(
                shape=shape, dtype="bool", name=f"{safe}.frozen_mask", initializer=_const(dense), aggregation="none"
            )
        scale = self._scale_value(d, slot)
        if scale is not None:
            slot.scale = self.add_variable(
                shape=scale.shape,
                dtype="float32",
                name=f"{safe}.lr_scale",
                initializer=_const(scale),
                aggregation="none",
            )
        return slot

    def _scale_value(self, d: _Decision, slot: Slot) -> np.ndarray | None:
        """The lr_scale values a slot holds: None (all 1), a scalar, or one per inner element."""
        if not isinstance(d.scale, np.ndarray):
            return None if d.scale == 1.0 else np.asarray(d.scale, np.float32)
        if slot.kind == "compact":
            if isinstance(d.mask, dict):
                return np.ones((d.n_trainable,), np.float32)
            return d.scale.reshape(-1)[d.mask.trainable_flat_indices()].astype(np.float32)
        return d.scale.astype(np.float32)

    # -- changing the plan -------------------------------------------------------
    def retarget(self, resolution, var_list=None) -> bool:
        """Follow a new resolution of the plan (``Freezer.update`` calls this).

        Element-mask changes of variables that stay partially frozen with the
        same strategy, and new ``lr_scale`` values, are written into the
        optimizer's variables: no retrace. Anything else (a variable becomes
        trainable, frozen or partial; a compact variable's trainable count or
        a strategy changes; a scale appears or disappears) rebuilds the slots
        and the inner optimizer: state is kept for every element that stays
        trainable, ``iterations`` is kept, newly trainable elements start with
        zero state (EMA averages with their current value), and the state of
        newly frozen variables is released.

        Args:
            resolution: the new resolution.
            var_list: the variables to build on, in the order Keras passes
                them (``model.trainable_variables`` after the flags changed),
                so that saved optimizer variables load in order.

        Returns:
            True when the train function must be retraced.
        """
        self._resolution, self._plan, self._layout = resolution, resolution.plan, None
        if not self.built:
            return False
        if var_list is None:
            var_list = [s.variable for s in resolution.states if s.state in (TRAINABLE, PARTIAL)]
        decisions = self._decisions(var_list)
        if self._in_place(decisions):
            self._layout = self._layout_for(decisions)
            return False
        self._rebuild(decisions, var_list)
        return True

    def _in_place(self, decisions) -> bool:
        """Write mask, index and scale changes into place if no slot changes shape or kind."""
        old = self._slots
        plans = []
        for d in decisions:
            kind = self._kind_of(d)
            if kind == "frozen":
                if id(d.variable) not in old.frozen_ids:
                    return False
                continue
            slot = old.by_id.get(id(d.variable))
            if slot is None or slot.kind != kind:
                return False
            if kind == "compact" and slot.index.shape[0] != d.n_trainable:
                return False
            scale = self._scale_value(d, slot)
            if (scale is None) != (slot.scale is None) or (
                scale is not None and tuple(scale.shape) != tuple(slot.scale.shape)
            ):
                return False
            plans.append((slot, d, scale))
        for slot, d, scale in plans:
            if slot.kind in ("restore", "mask") and not np.array_equal(slot.mask.numpy(), d.mask.dense()):
                held = self._state_snapshot(slot)
                slot.mask.assign(d.mask.dense())
                self._carry_state(slot, *held)
            elif slot.kind == "compact" and not np.array_equal(slot.index.numpy(), d.mask.trainable_flat_indices()):
                held = self._state_snapshot(slot)
                slot.index.assign(d.mask.trainable_flat_indices().astype(np.int32))
                self._carry_state(slot, *held)
            if scale is not None:
                slot.scale.assign(scale)
        return True

    def _inner_state(self, slot):
        """Inner optimizer variables that hold per-element state of ``slot``."""
        prefix = var_path(slot.inner_variable).replace("/", "_") + "_"
        size = int(np.prod(slot.inner_variable.shape, dtype=np.int64))
        out = []
        for w in self.inner_optimizer.variables:
            name = w.name
            if name.startswith(prefix) and int(np.prod(w.shape, dtype=np.int64)) == size:
                out.append((name[len(prefix) :], w))
        return out

    @staticmethod
    def _elements(slot, trained_only: bool) -> np.ndarray:
        """Flat indices of the model elements behind a slot's per-element state, in state order."""
        if slot.kind == "compact":
            return np.asarray(slot.index.numpy()).astype(np.int64)
        idx = np.arange(int(np.prod(slot.shape, dtype=np.int64)))
        if trained_only and slot.mask is not None:
            idx = idx[~np.asarray(slot.mask.numpy()).reshape(-1)]
        return idx

    def _state_snapshot(self, slot) -> tuple[np.ndarray, dict]:
        """``(elements, {suffix: values})`` of the state a slot holds for its trainable elements."""
        idx = self._elements(slot, trained_only=True)
        pick = slice(None) if slot.kind == "compact" else idx
        return idx, {sfx: np.asarray(w.numpy()).reshape(-1)[pick] for sfx, w in self._inner_state(slot)}

    def _carry_state(self, slot, old_idx: np.ndarray, old_state: dict) -> None:
        """Give ``slot`` the state of :meth:`_state_snapshot`, element by element.

        Elements that held state keep it; every other element starts fresh: zero,
        or for EMA averages the element's current value (what Keras does at step 0).
        """
        new_idx = self._elements(slot, trained_only=False)
        value = np.asarray(slot.variable.numpy()).reshape(-1)[new_idx]
        pos = np.minimum(np.searchsorted(old_idx, new_idx), max(old_idx.size - 1, 0))
        kept = old_idx[pos] == new_idx if old_idx.size else np.zeros(new_idx.size, bool)
        for suffix, w in self._inner_state(slot):
            if suffix in old_state:
                fresh = value if suffix == "average" else np.zeros_like(value)
                out = np.where(kept, old_state[suffix][pos], fresh.astype(old_state[suffix].dtype))
                w.assign(out.reshape(w.shape))

    def _rebuild(self, decisions, var_list):
        """New slots and a new inner optimizer; state carried by element."""
        old_slots, old_inner = self._slots, self.inner_optimizer
        held = {id(slot.variable): self._state_snapshot(slot) for slot in old_slots.ordered}
        shared = _keyed(old_inner.variables)
        ours = {id(w) for s in old_slots.ordered for w in (s.mask, s.index, s.shadow, s.scale) if w is not None}
        self._variables[:] = [w for w in self._variables if id(w) not in ours]
        inner = type(old_inner).from_config(old_inner.get_config())
        self._set_inner(inner)
        self._layout = None
        with keras.name_scope(self.name, caller=self):
            self._build_slots(decisions)
        per_element = {id(w) for s in self._slots.ordered for _, w in self._inner_state(s)}
        for key, w in _keyed(inner.variables, values=False).items():
            if id(w) not in per_element and key in shared:
                w.assign(shared[key])  # iterations, learning rate, factored and other global state
        for slot in self._slots.ordered:
            if id(slot.variable) in held:
                self._carry_state(slot, *held[id(slot.variable)])
        keras.optimizers.Optimizer.build(self, var_list)

    @_no_tracking
    def _set_inner(self, inner):
        self.inner_optimizer = inner

    def _warn_mask(self):
        reasons = inexact_reasons(self.inner_optimizer)
        if reasons and not self._mask_warned:
            self._mask_warned = True
            warnings.warn(
                "strategy 'mask' (gradient masking alone) is not exact with "
                f"{type(self.inner_optimizer).__name__}: {'; '.join(reasons)}. Frozen "
                "elements will drift; use strategy 'restore' or 'compact'.",
                FreezeWarning,
                stacklevel=3,
            )

    # -- applying ------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "FreezingOptimizer.apply(grads) without variables needs a built "
                    "optimizer; pass the variables (or call build) first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} variables.")
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        slots = self._slots
        all_steps = bool(getattr(self.inner_optimizer, "use_ema", False))
        inner_g, inner_v, pending, seen, writes = [], [], [], set(), []
        for g, v in zip(grads, trainable_variables):
            if id(v) in slots.frozen_ids:
                continue
            slot = slots.by_id.get(id(v))
            if slot is None:
                raise ValueError(
                    f"FreezingOptimizer got a gradient for {var_path(v)!r}, which it "
                    "was not built with. Create the Freezer after the model is built."
                )
            if g is None and not all_steps:
                continue
            seen.add(id(v))
            ig, ctx = slot.prepare(g, writes)
            if ig is not None:
                inner_g.append(ig)
                inner_v.append(slot.inner_variable)
            if slot.kind != "train" or ctx is not None:
                pending.append((slot, ctx))
        if all_steps:
            for slot in slots.ordered:
                if slot.kind in ("restore", "compact") and id(slot.variable) not in seen:
                    pending.append((slot, slot.prepare(None, writes)[1]))
        write_all(writes)
        if self.track_gradient_norms:
            self._record_norms(inner_g, inner_v)
        if inner_g:
            self.inner_optimizer.apply(inner_g, inner_v)
        else:
            self.inner_optimizer.iterations.assign_add(1)
        writes = []
        for slot, ctx in pending:
            slot.finish(ctx, writes)
        write_all(writes)

    def _record_norms(self, grads, variables):
        import tensorflow as tf

        by_inner = {id(s.inner_variable): s for s in self._slots.ordered}
        tn, fn = tf.constant(0.0), tf.constant(0.0)
        for g, v in zip(grads, variables):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            g = tf.cast(g, tf.float32)
            slot = by_inner[id(v)]
            if slot.mask is not None:
                frozen = tf.where(slot.mask.value, g, tf.zeros_like(g))
                fn += tf.reduce_sum(tf.square(frozen))
                tn += tf.reduce_sum(tf.square(g - frozen))
            else:
                tn += tf.reduce_sum(tf.square(g))
        write_all([(self._slots.norms[0], _assign, (tf.sqrt(tn),)), (self._slots.norms[1], _assign, (tf.sqrt(fn),))])

    def finalize_variable_values(self, var_list):
        if not self.built or not getattr(self.inner_optimizer, "use_ema", False):
            return
        writes = []
        pending = [(s, s.prepare(None, writes)[1]) for s in self._slots.ordered if s.kind in ("restore", "compact")]
        write_all(writes)
        self.inner_optimizer.finalize_variable_values(self.inner_optimizer._trainable_variables)
        writes = []
        for slot, ctx in pending:
            slot.finish(ctx, writes)
        write_all(writes)

    # -- serialization -------------------------------------------------------
    def get_config(self):
        plan = None
        if self._plan is not None:
            try:
                plan = self._plan.to_dict()
            except PlanError:
                plan = None
        layout = self._layout
        if layout is None and self._resolution is not None:
            layout = self._layout_for(self._decisions([]))
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "plan": plan,
            "strategy": self._strategy,
            "layout": layout,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        plan = config.pop("plan", None)
        layout = config.pop("layout", None)
        return cls(
            inner,
            Plan.from_dict(plan) if plan else None,
            strategy=config.pop("strategy", "auto"),
            name=config.pop("name", None),
            _layout=layout,
        )


def find_freezing_optimizer(model) -> FreezingOptimizer | None:
    """The FreezingOptimizer compiled into ``model``, looking through wrappers such as LossScaleOptimizer."""
    opt = getattr(model, "optimizer", None)
    while opt is not None and not isinstance(opt, FreezingOptimizer):
        opt = getattr(opt, "inner_optimizer", None)
    return opt


def freezer_of(model, given, who: str):
    """``given``, else the Freezer whose ``wrap`` made ``model``'s optimizer.

    Raises:
        TypeError: there is neither; the message says how to fix it.
    """
    if given is not None:
        return given
    opt = find_freezing_optimizer(model)
    if opt is None or opt.freezer is None:
        raise TypeError(
            f"{who} needs a Freezer: compile the model with optimizer=frz.wrap(...) or pass {who}(..., freezer=frz)."
        )
    return opt.freezer


def _keyed(variables, values=True) -> dict:
    """Variables by ``(name, shape, occurrence)``: names alone repeat (Adafactor's factored slots)."""
    out, seen = {}, {}
    for w in variables:
        k = (re.sub(r"_\d+$", "", w.name), tuple(int(d) for d in w.shape))  # unnamed: variable, variable_1
        seen[k] = seen.get(k, 0) + 1
        out[(*k, seen[k])] = np.asarray(w.numpy()) if values else w
    return out


def _const(value):
    value = np.asarray(value)

    def init(shape, dtype=None):
        return value.reshape(shape)

    return init
