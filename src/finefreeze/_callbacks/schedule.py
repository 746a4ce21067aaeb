"""Callbacks that change the plan while ``fit`` runs: ``FreezeSchedule``, ``GradualUnfreezing``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras

from finefreeze._callbacks.lookup import freezer_of
from finefreeze._errors import PlanError
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import Rule, train
from finefreeze._resolve.resolve import resolve

__all__ = ["FreezeSchedule", "GradualUnfreezing"]


def _as_plan(value, where: str) -> Plan:
    if isinstance(value, Plan):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(r, Rule) for r in value):
        return Plan(value)
    raise PlanError(f"{where}: expected an ff.Plan or a list of rules, got {type(value).__name__}.")


class _PlanCallback(keras.callbacks.Callback):
    """Shared plumbing: find the Freezer, validate plans early, apply a plan once."""

    def __init__(self, freezer: Any = None):
        super().__init__()
        self._freezer = freezer
        self._applied: Any = None
        self._started = False

    def _find_freezer(self):
        return freezer_of(self.model, self._freezer, type(self).__name__)

    def _validate(self, frz, plans: dict) -> None:
        """Resolve every plan before training starts: a bad one fails now, not at epoch 7."""
        for key, plan in plans.items():
            try:
                resolve(plan, frz._target)
            except PlanError as e:
                raise PlanError(f"{type(self).__name__} plan for {key}: {e}") from None

    def on_epoch_begin(self, epoch, logs=None):
        if not self._started:
            self._started = True
            if epoch > 0:  # a resumed run (initial_epoch, BackupAndRestore): weights were just restored
                self.freezer._rebase()
        self._on_epoch(epoch)

    def _on_epoch(self, epoch) -> None:
        pass

    def on_train_begin(self, logs=None):
        self._started = False

    def _apply(self, key, plan: Plan) -> None:
        if self._applied == key:
            return
        self.freezer.update(plan)
        self._applied = key


class FreezeSchedule(_PlanCallback):
    """Switch plans at given epochs (or optimizer steps) during ``fit``.

    At the start of each epoch (``by="epoch"``) or batch (``by="step"``,
    counted by the optimizer's ``iterations``), the plan of the largest key
    not after the current epoch or step is put in force with
    ``Freezer.update`` (once per key). With ``steps_per_execution=k`` Keras
    calls batch callbacks every ``k`` steps, so a step-keyed change happens
    at the first such boundary at or after its step. Every plan is resolved
    when training starts, so a bad one fails before the first step.

    Args:
        schedule: ``{epoch or step: plan}``; keys are integers >= 0.
        freezer: the :class:`Freezer`; defaults to the one whose ``wrap``
            made the model's optimizer.
        by: ``"epoch"`` or ``"step"``.

    Raises:
        PlanError: a bad key or plan (at construction or when training starts).

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="a"),
        ...                       keras.layers.Dense(2, name="b")], name="m")
        >>> frz = ff.Freezer(m, ff.Plan([ff.freeze("**/a/**")]))
        >>> m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
        >>> cb = ff.callbacks.FreezeSchedule({2: ff.Plan()})   # release the backbone at epoch 2
        >>> _ = m.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=3, verbose=0, callbacks=[cb])
        >>> [h["step"] for h in frz.history]
        [0, 2]
    """

    def __init__(self, schedule: Mapping[int, Plan | Sequence[Rule]], freezer: Any = None, *, by: str = "epoch"):
        super().__init__(freezer)
        if by not in ("epoch", "step"):
            raise PlanError(f"FreezeSchedule(by={by!r}): choose 'epoch' or 'step'.")
        if not isinstance(schedule, Mapping) or not schedule:
            raise PlanError("FreezeSchedule needs a non-empty {epoch or step: plan} mapping.")
        plans = {}
        for k, v in schedule.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise PlanError(f"FreezeSchedule key {k!r}: use an integer {by} >= 0.")
            plans[k] = _as_plan(v, f"FreezeSchedule[{k}]")
        self.schedule = dict(sorted(plans.items()))
        self.by = by

    def _due(self, now: int):
        keys = [k for k in self.schedule if k <= now]
        if keys:
            self._apply(keys[-1], self.schedule[keys[-1]])

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.freezer = self._find_freezer()
        self._validate(self.freezer, {f"{self.by} {k}": p for k, p in self.schedule.items()})

    def _on_epoch(self, epoch):
        if self.by == "epoch":
            self._due(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.by == "step":
            self._due(self.freezer._step)


class GradualUnfreezing(_PlanCallback):
    """Release groups of layers one at a time, from the top of the network down (ULMFiT).

    The first ``every`` epochs train what the plan in force when ``fit``
    starts leaves trainable (say, the head); each further ``every`` epochs
    add the next group, so with ``every=1`` epoch ``e`` (0-based) trains the
    head plus ``groups[:e]``. A group is a selector, a ``train(...)`` rule
    (with its own ``lr_scale`` if you like), or a list of those; selectors
    get ``lr_scales[i]`` when given. Changes happen at epoch starts.

    Args:
        groups: top group first.
        every: epochs between releases.
        freezer: the :class:`Freezer`; defaults to the one whose ``wrap``
            made the model's optimizer.
        lr_scales: optional ``lr_scale`` per group for its selectors.

    Raises:
        PlanError: an empty group list, a freeze rule in a group, bad
            ``every`` or ``lr_scales``, or a group that selects nothing (when
            training starts).

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="low"),
        ...     keras.layers.Dense(4, name="mid"), keras.layers.Dense(2, name="head")], name="m")
        >>> frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**")]))
        >>> m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
        >>> cb = ff.callbacks.GradualUnfreezing(["**/mid/**", ff.train("**/low/**", lr_scale=0.1)])
        >>> _ = m.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=3, verbose=0, callbacks=[cb])
        >>> frz.history[-1]["plan"][-1]
        "train('**/low/**', lr_scale=0.1)"
    """

    def __init__(
        self,
        groups: Sequence[Any],
        every: int = 1,
        freezer: Any = None,
        *,
        lr_scales: Sequence[float] | None = None,
    ):
        super().__init__(freezer)
        if isinstance(groups, (str, Rule)) or not groups:
            raise PlanError("GradualUnfreezing needs a non-empty list of groups (top group first).")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise PlanError(f"GradualUnfreezing(every={every!r}): use a positive number of epochs.")
        if lr_scales is not None and len(lr_scales) != len(groups):
            raise PlanError(f"GradualUnfreezing: {len(lr_scales)} lr_scales for {len(groups)} groups.")
        self.groups = [self._rules(i, g, None if lr_scales is None else lr_scales[i]) for i, g in enumerate(groups)]
        self.every = every
        self._base: Plan | None = None

    @staticmethod
    def _rules(i, group, scale) -> tuple[Rule, ...]:
        members = group if isinstance(group, (list, tuple)) else [group]
        out = []
        for m in members:
            if isinstance(m, Rule):
                if m.freezes:
                    raise PlanError(f"GradualUnfreezing group {i}: {m!r} freezes; groups release with train(...).")
                out.append(m)
            else:
                out.append(train(m, lr_scale=scale))
        return tuple(out)

    def stage_plan(self, k: int) -> Plan:
        """The plan with the first ``k`` groups released (``0 <= k <= len(groups)``).

        Raises:
            PlanError: ``k`` out of range, or no plan to start from yet (before
                ``fit`` without ``freezer=``).
        """
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(self.groups):
            raise PlanError(f"GradualUnfreezing.stage_plan({k!r}): give 0 to {len(self.groups)} (the groups released).")
        base = self._base
        if base is None:
            frz = self._freezer if self._freezer is not None else getattr(self, "freezer", None)
            if frz is None:
                raise PlanError(
                    "GradualUnfreezing.stage_plan: the plan it starts from is the Freezer's; give freezer= or "
                    "call it once fit has started."
                )
            base = self._strip_groups(frz.plan)
        rules = [r for g in self.groups[:k] for r in g]
        return Plan([*base.rules, *rules], strict=base.strict, batchnorm=base.batchnorm)

    def _strip_groups(self, plan: Plan) -> Plan:
        """The plan before any group was released: ``plan`` less a released stage's rules at its end.

        A model saved (or backed up) in the middle of the schedule carries
        its stage's plan; resuming from it must rebuild the same stages.
        """
        rules = [repr(r) for r in plan.rules]
        for k in range(len(self.groups), 0, -1):
            tail = [repr(r) for g in self.groups[:k] for r in g]
            if len(rules) > len(tail) and rules[-len(tail) :] == tail:
                return Plan(plan.rules[: -len(tail)], strict=plan.strict, batchnorm=plan.batchnorm)
        return plan

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.freezer = self._find_freezer()
        if self._base is None:
            self._base = self._strip_groups(self.freezer.plan)
        self._validate(self.freezer, {f"group {k - 1}": self.stage_plan(k) for k in range(1, len(self.groups) + 1)})

    def _on_epoch(self, epoch):
        k = min(len(self.groups), epoch // self.every)
        if k == 0 and self._applied is None:
            self._applied = 0  # the starting plan is already in force
            return
        self._apply(k, self.stage_plan(k))
