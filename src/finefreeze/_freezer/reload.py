"""Rebuild the Freezer of a loaded model from what its FreezingOptimizer saved.

A ``.keras`` file keeps the optimizer's config (plan, strategy, layout) and
its variables (frozen masks, compact indices, ``lr_scale`` values). The
masks are the truth: a plan with ``where=`` predicates, evaluated on values
that training has since changed, would resolve differently today. So the
saved plan is used only when it still resolves to exactly the saved masks;
otherwise the Freezer gets a plan made of the saved masks themselves.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._errors import PlanError
from finefreeze._kinds import Kind
from finefreeze._optimizer.checkpoint import enforced
from finefreeze._optimizer.wrapper import find_freezing_optimizer
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import freeze, train
from finefreeze._resolve.resolve import PARTIAL, resolve
from finefreeze._resolve.targets import collect
from finefreeze._slices.calls import set_sliced

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Resumable", "checkpoint_plan", "held_dense", "masks_plan", "plan_of_masks", "rebuild_freezer"]


def _exact(path: str) -> str:
    return "re:" + re.escape(path)


def _saved_masks(opt) -> dict[str, tuple[str, np.ndarray | None, np.ndarray | float]]:
    """``{path: (kind, frozen mask or None, scale)}`` as a built optimizer enforces them."""
    out = {}
    by_path = {e.path: e for e in opt._enforcers}
    for entry in opt._layout:
        enf = by_path.get(entry.path)
        if entry.kind == Kind.FROZEN or enf is None:
            out[entry.path] = ("frozen", None, 1.0)
            continue
        arrays = [None if w is None else to_numpy(w) for w in (enf.mask, enf.index, enf.scale)]
        out[entry.path] = enforced(enf.shape, *arrays)
    return out


def masks_plan(opt) -> Plan:
    """A plan that selects exactly the elements and scales a built optimizer enforces."""
    return plan_of_masks(_saved_masks(opt))


def plan_of_masks(saved: dict) -> Plan:
    """A plan that selects exactly ``{path: (kind, frozen mask, scale)}``."""
    rules = []
    for path, (kind, frozen, scale) in saved.items():
        sel = _exact(path)
        if kind == Kind.FROZEN:
            rules.append(freeze(sel))
            continue
        trained = ~frozen if frozen is not None else None
        if isinstance(scale, np.ndarray):
            for value in np.unique(scale):
                pick = scale == value
                if trained is not None:
                    pick = pick & trained
                if value != 1.0 and pick.any():
                    rules.append(train(sel, mask=pick, lr_scale=float(value)))
        elif scale != 1.0:
            rules.append(train(sel, lr_scale=scale))
        if frozen is not None and frozen.any():
            rules.append(freeze(sel, mask=frozen))
    return Plan(rules)


def _same(res, saved: dict) -> bool:
    """Whether a resolution enforces exactly the saved masks and scales."""
    for s in res.states:
        got = saved.get(s.path)
        if got is None:
            continue
        kind, frozen, scale = got
        state = "frozen" if s.state not in ("trainable", PARTIAL) else ("partial" if s.state == PARTIAL else "train")
        if state != kind:
            return False
        if frozen is not None and not np.array_equal(s.mask.dense(), frozen):
            return False
        mine = s.lr_scales if s.lr_scales is not None else s.lr_scale
        if not np.array_equal(
            np.broadcast_to(np.asarray(mine, np.float32), np.shape(scale)), np.asarray(scale, np.float32)
        ):
            return False
    return True


def rebuild_freezer(cls, model, opt):
    """The Freezer of ``model`` whose ``FreezingOptimizer`` ``opt`` has no Freezer (a loaded model)."""
    plan = opt.plan or Plan()
    if opt.built and opt._layout is not None and not opt._placeholders:
        saved = _saved_masks(opt)
        try:
            ok = opt.plan is not None and _same(resolve(opt.plan, collect(model)), saved)
        except PlanError:
            ok = False
        plan = opt.plan if ok else masks_plan(opt)
    # an optimizer saved without a Freezer trained on the dense gradients: it resumes bit for bit on them
    gradients = opt._saved_gradients or {"mode": "dense"}
    return cls(model, plan, strategy=opt.strategy, gradients=gradients.get("mode", "dense"))


def held_dense(frz, gradients: dict | None) -> set[str] | None:
    """The paths of the kernels a saved run held dense (``gradients="auto"``), matched to the model's paths.

    A ``Sequential`` model loaded from a file names its variables without the
    model's name (``big/kernel`` for ``net/big/kernel``): a saved path matches
    the one it ends with, or that ends with it.
    """
    if frz._gradients != "auto" or gradients is None:
        return None
    paths = [s.path for s in frz._res.states]
    held = set()
    for p in gradients.get("held_dense", ()):
        hits = [q for q in paths if q == p] or [q for q in paths if q.endswith("/" + p) or p.endswith("/" + q)]
        if len(hits) == 1:
            held.add(hits[0])
    return held


def checkpoint_plan(frz, saved: dict, plan_dict: dict | None) -> Plan | None:
    """The plan that puts in force the masks a checkpoint was saved under; None when they are in force already.

    The saved plan is taken when it resolves to exactly the saved masks (so a
    schedule recognises its stage), else a plan of the masks themselves.
    """
    if _same(frz._res, saved):
        return None
    plan = None
    if plan_dict:
        try:
            candidate = Plan.from_dict(plan_dict)
            if _same(resolve(candidate, frz._target), saved):
                plan = candidate
        except PlanError:
            plan = None
    return plan if plan is not None else plan_of_masks(saved)


class Resumable:
    """What a ``Freezer`` does when training resumes: a checkpoint's masks in force, a loaded model's Freezer."""

    def _adopt_checkpoint(self, saved: dict, plan: dict | None, step: int, gradients: dict | None = None) -> None:
        """Put in force the masks (and kernels held dense) a checkpoint saved (``load_own_variables`` calls this).

        Nothing changes when the plan in force already enforces them.
        """
        self._checkpoint_loads += 1
        self._hold(held_dense(self, gradients))
        new = checkpoint_plan(self, saved, plan)
        if new is None:
            return
        self._rebase()  # the model's weights were loaded just before: they are the baseline now
        self._update(new)
        self._history[-1].update(step=step, resumed=True)

    def _hold(self, held: set[str] | None) -> None:
        """Hold dense the kernels at ``held`` (a saved run's, ``gradients="auto"``); None: as they are."""
        if held is None or held == self._held:
            return
        self._held = held
        if set_sliced(self._target, self._res, self, self._slicing, self._held):
            self._follow_standins()
            self._retrace()

    @classmethod
    def of(cls, model: Any) -> Self | None:
        """The Freezer of a model compiled with a ``FreezingOptimizer``, or None.

        For a model whose optimizer a Freezer's ``wrap`` made, that Freezer.
        For a loaded model (``keras.models.load_model``) the Freezer is
        rebuilt from what the optimizer saved: its plan when that plan still
        resolves to the saved masks, else a plan of the saved masks
        themselves; its fingerprint is taken now. Schedule callbacks use this,
        so they resume a loaded model.

        Args:
            model: a Keras model.

        Returns:
            The Freezer, or None when the model has no ``FreezingOptimizer``.

        Example:
            >>> import keras, numpy as np, finefreeze as ff
            >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
            >>> frz = ff.Freezer(m, ff.Plan([ff.freeze("**/d/kernel[0]")]))
            >>> m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
            >>> ff.Freezer.of(m) is frz
            True
        """
        opt = find_freezing_optimizer(model)
        if opt is None:
            return None
        if opt._freezer is not None:
            return opt._freezer
        frz = rebuild_freezer(cls, model, opt)
        frz._resume(opt)
        return frz

    def _resume(self, opt) -> None:
        """Become the Freezer of ``opt``, a loaded model's optimizer, as the saved run left it."""
        self._hold(held_dense(self, opt._saved_gradients or {"mode": "dense"}))
        opt._adopt_resolution(self._res)
        self._history[0]["step"] = int(to_numpy(opt.iterations))  # the plan was in force before the save
        opt._bind_freezer(self, strong=True)
        self._wrapped.append(weakref.ref(opt))
        if opt._placeholders:  # saved before its first step: the plan's masks go into the optimizer now
            self._update(self._res.plan)
