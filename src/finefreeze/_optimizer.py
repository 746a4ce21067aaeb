"""``FreezingOptimizer``: a Keras optimizer that enforces a plan exactly.

Built the way Keras' ``LossScaleOptimizer`` wraps an optimizer: it holds an
``inner_optimizer``, delegates ``learning_rate`` and ``iterations``, its
``variables`` are its own plus the inner ones, and ``get_config`` serializes
the inner optimizer. Its own ``apply`` is where freezing happens: fully frozen
variables never reach the inner optimizer; partially frozen ones go through
their strategy's ``prepare`` / ``finish`` hooks around the inner update.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np

from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._plan import Plan
from finefreeze._resolve import FROZEN, PARTIAL, TRAINABLE, UNTRAINED
from finefreeze._strategies import STRATEGIES, Slot, choose
from finefreeze._targets import var_path

__all__ = ["FreezingOptimizer", "inexact_reasons"]

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
    def _decisions(self, var_list):
        """``[(variable, state, mask ElementMask|None, n_trainable, lr_scale)]``."""
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
                out.append((v, TRAINABLE, None, None, 1.0))
            elif st.lr_scales is not None:
                raise PlanError(
                    f"variable {st.path!r} (shape {st.info.shape}) has trainable elements with "
                    "different lr_scale values; one lr_scale per variable is supported. "
                    "Give the rules that train this variable the same lr_scale."
                )
            elif st.state in (FROZEN, UNTRAINED):
                out.append((v, FROZEN, None, None, 1.0))
            else:
                out.append((v, st.state, st.mask, st.n_trainable, st.lr_scale))
        return out

    def _decisions_from_layout(self, var_list):
        entries = list(self._layout["variables"]) + [{"path": p, "strategy": "frozen"} for p in self._layout["frozen"]]
        out = []
        for v in var_list:
            e = _match_layout(var_path(v), entries)
            if e is None:
                out.append((v, TRAINABLE, None, None, 1.0))
            elif e["strategy"] == "frozen":
                out.append((v, FROZEN, None, None, 1.0))
                if getattr(v, "trainable", False) and isinstance(v, keras.Variable):
                    v.trainable = False  # per-variable flags are not saved in .keras files
            else:
                state = TRAINABLE if e["strategy"] == "train" else PARTIAL
                out.append((v, state, e, e.get("n_trainable"), e.get("lr_scale", 1.0)))
        return out

    def _kind(self, variable, n_trainable: int) -> str:
        """The concrete strategy of one partially frozen variable."""
        size = int(np.prod(variable.shape, dtype=np.int64))
        kind = choose(self._strategy, n_trainable, size, getattr(variable, "constraint", None) is not None)
        if kind == "compact" and isinstance(self.inner_optimizer, keras.optimizers.MultiOptimizer):
            return "restore"  # MultiOptimizer routes by the model variable's path
        return kind

    def _layout_for(self, decisions) -> dict:
        """What the config records so that a loaded optimizer builds the same slots."""
        entries, frozen = [], []
        for v, state, mask, n_trainable, lr_scale in decisions:
            path, shape = var_path(v), [int(d) for d in v.shape]
            if state == FROZEN:
                frozen.append(path)
            elif state == PARTIAL:
                kind = mask["strategy"] if isinstance(mask, dict) else self._kind(v, n_trainable)
                entries.append(
                    {
                        "path": path,
                        "strategy": kind,
                        "shape": shape,
                        "n_trainable": int(n_trainable),
                        "lr_scale": lr_scale,
                    }
                )
            elif lr_scale != 1.0:
                entries.append({"path": path, "strategy": "train", "shape": shape, "lr_scale": lr_scale})
        return {"variables": entries, "frozen": sorted(frozen)}

    @_no_tracking
    def build(self, var_list):
        if self.built:
            return
        decisions = self._decisions(var_list)
        if self._layout is None:
            self._layout = self._layout_for(decisions)
        slots = _Slots()
        for v, state, mask, n_trainable, lr_scale in decisions:
            path = var_path(v)
            if state == FROZEN:
                slots.frozen_ids.add(id(v))
                continue
            shape = tuple(int(d) for d in v.shape)
            if state == TRAINABLE:
                slot = Slot(path, v, "train", shape, lr_scale)
            else:
                slot = self._partial_slot(v, path, shape, mask, n_trainable, lr_scale)
            slots.by_id[id(v)] = slot
            slots.ordered.append(slot)
        import tensorflow as tf

        slots.norms = tuple(
            tf.Variable(0.0, trainable=False, name=n, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for n in ("grad_norm_trainable", "grad_norm_frozen")
        )
        self._slots = slots
        if any(s.kind == "mask" for s in slots.ordered):
            self._warn_mask()
        self.inner_optimizer.build([s.inner_variable for s in slots.ordered])
        super().build(var_list)

    def _partial_slot(self, v, path, shape, mask, n_trainable, lr_scale) -> Slot:
        if isinstance(mask, dict):  # from a saved layout: values arrive on load
            kind = mask["strategy"]
            dense = np.ones(shape, dtype=bool)
            idx = np.full((n_trainable,), -1, dtype=np.int32)
        else:
            kind = self._kind(v, n_trainable)
            dense = mask.dense()
            idx = mask.trainable_flat_indices().astype(np.int32) if kind == "compact" else None
        safe = path.replace("/", ".")
        if kind == "compact":
            index = self.add_variable(
                shape=idx.shape, dtype="int32", name=f"{safe}.index", initializer=_const(idx), aggregation="none"
            )
            # Refilled from the model variable at every step (gather).
            shadow = self.add_variable(
                shape=idx.shape, dtype=v.dtype, name=f"{safe}.compact", initializer="zeros", aggregation="none"
            )
            return Slot(path, v, kind, shape, lr_scale, index=index, shadow=shadow)
        m = self.add_variable(
            shape=shape, dtype="bool", name=f"{safe}.frozen_mask", initializer=_const(dense), aggregation="none"
        )
        return Slot(path, v, kind, shape, lr_scale, mask=m)

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
        inner_g, inner_v, pending, seen = [], [], [], set()
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
            ig, ctx = slot.prepare(g)
            if ig is not None:
                inner_g.append(ig)
                inner_v.append(slot.inner_variable)
            if slot.kind != "train" or ctx is not None:
                pending.append((slot, ctx))
        if all_steps:
            for slot in slots.ordered:
                if slot.kind in ("restore", "compact") and id(slot.variable) not in seen:
                    pending.append((slot, slot.prepare(None)[1]))
        if self.track_gradient_norms:
            self._record_norms(inner_g, inner_v)
        if inner_g:
            self.inner_optimizer.apply(inner_g, inner_v)
        else:
            self.inner_optimizer.iterations.assign_add(1)
        for slot, ctx in pending:
            slot.finish(ctx)

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
        self._slots.norms[0].assign(tf.sqrt(tn))
        self._slots.norms[1].assign(tf.sqrt(fn))

    def finalize_variable_values(self, var_list):
        if not self.built or not getattr(self.inner_optimizer, "use_ema", False):
            return
        pending = [(s, s.prepare(None)[1]) for s in self._slots.ordered if s.kind in ("restore", "compact")]
        self.inner_optimizer.finalize_variable_values(self.inner_optimizer._trainable_variables)
        for slot, ctx in pending:
            slot.finish(ctx)

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


def _match_layout(path, entries):
    """The layout entry of ``path``; saved paths may have lost or gained a
    model-name prefix (a reloaded Sequential drops its own name)."""
    exact = [e for e in entries if e["path"] == path]
    if exact:
        return exact[0]
    near = [e for e in entries if e["path"].endswith("/" + path) or path.endswith("/" + e["path"])]
    if len(near) > 1:
        raise PlanError(
            f"variable {path!r} matches several saved freeze entries "
            f"({', '.join(e['path'] for e in near)}); give layers unique names."
        )
    return near[0] if near else None


def _const(value):
    value = np.asarray(value)

    def init(shape, dtype=None):
        return value.reshape(shape)

    return init
