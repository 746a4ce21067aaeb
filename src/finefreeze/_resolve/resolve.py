"""Resolve a plan against a target's variables into an immutable resolution.

For every element the last rule that selects it decides; elements no rule
selects keep their Keras state. Variables Keras does not train by nature
(moving statistics, seed states) are outside plans; so are the statistics
Keras overwrites with each step's value (float8's scales and amax
histories), which train while their layer trains anything and stay fixed
with a frozen layer. A base kernel that ``enable_lora`` switched off is a
plan target, frozen unless a rule trains it. The result records, per
variable, its state, its frozen mask (stored compactly) and which rules
decided how many elements.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any

import numpy as np

from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import Rule
from finefreeze._plan.selectors import match_all
from finefreeze._resolve.axes import fraction_mask
from finefreeze._resolve.masks import ElementMask
from finefreeze._resolve.scopes import ambiguity_note
from finefreeze._resolve.standins import standin_note
from finefreeze._resolve.targets import Target, VarInfo, quantization_note

__all__ = ["FOLLOWS_LAYER", "VarState", "Resolution", "resolve"]

TRAINABLE, FROZEN, PARTIAL, UNTRAINED = "trainable", "frozen", "partial", "untrained"
#: ``decided_by``'s decider of a statistic that takes its layer's state (:func:`_follow_layers`); -1: no rule
FOLLOWS_LAYER = -2


@dataclasses.dataclass(frozen=True, eq=False)
class VarState:
    """What a plan decided for one variable."""

    info: VarInfo
    state: str
    mask: ElementMask | None  # frozen-element mask, for partial variables
    decided_by: tuple[tuple[int, int], ...]  # (rule index or -1, elements)
    lr_scale: float = 1.0  # uniform step multiplier of trainable elements
    lr_scales: np.ndarray | None = None  # per-element multipliers when not uniform

    @property
    def path(self) -> str:
        return self.info.path

    @property
    def variable(self):
        return self.info.variable

    @property
    def n_frozen(self) -> int:
        if self.state == PARTIAL:
            return self.mask.n_frozen
        return self.info.size if self.state == FROZEN else 0

    @property
    def n_trainable(self) -> int:
        if self.state == PARTIAL:
            return self.mask.n_trainable
        return self.info.size if self.state == TRAINABLE else 0

    def frozen_mask(self) -> np.ndarray:
        """Dense bool array (True = frozen); untrained variables count as frozen."""
        if self.state == PARTIAL:
            return self.mask.dense()
        return np.full(self.info.shape, self.state != TRAINABLE, dtype=bool)


@dataclasses.dataclass(frozen=True, eq=False)
class Resolution:
    """A plan resolved against a target: one :class:`VarState` per variable."""

    plan: Plan
    target: Target
    states: tuple[VarState, ...]
    frozen_layers: tuple[Any, ...]  # BatchNormalization layers frozen as layers

    def __post_init__(self):
        object.__setattr__(self, "_by_id", {id(s.info.variable): s for s in self.states})
        by_name = {}
        for s in self.states:
            for n in s.info.names:
                by_name.setdefault(n, s)
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_layer_frozen_ids", {id(v) for layer in self.frozen_layers for v in layer.weights})

    def kind_of(self, s: VarState) -> str:
        """How a variable is kept: ``trainable``, ``partial``, ``frozen`` or
        ``untrained``; moving statistics of a layer frozen as a layer count
        as ``frozen`` (they must not move), others as ``untrained``."""
        if s.state == UNTRAINED and id(s.variable) in self._layer_frozen_ids:
            return FROZEN
        return s.state

    def lookup(self, variable) -> VarState | None:
        s = self._by_id.get(id(variable))
        if s is None:
            raw = getattr(variable, "value", None)
            for st in self.states:
                if st.info.raw is variable or (raw is not None and st.info.raw is raw):
                    return st
        return s

    def by_path(self, path: str) -> VarState | None:
        return self._by_name.get(path)

    @property
    def trainable_states(self) -> list[VarState]:
        return [s for s in self.states if s.state in (TRAINABLE, PARTIAL)]


def closest(text: str, paths: list[str]) -> list[str]:
    got = difflib.get_close_matches(text, paths, n=3, cutoff=0.0)
    return got or paths[:3]


def _where(i: int, rule: Rule, vi: VarInfo) -> str:
    return f"rule {i + 1} {rule!r} on {vi.path!r} (shape {vi.shape}, {vi.dtype})"


def _broadcast(i, rule, vi, arr, what) -> np.ndarray:
    try:
        return np.broadcast_to(arr, vi.shape)
    except ValueError:
        raise PlanError(
            f"{_where(i, rule, vi)}: {what} has shape {np.shape(arr)}, which does not "
            f"broadcast to the variable's shape {vi.shape}; give a bool array of "
            f"shape {vi.shape} (or one that broadcasts to it)."
        ) from None


def _element_selection(i: int, rule: Rule, vi: VarInfo, cache: dict | None = None) -> np.ndarray | None:
    """Elements of ``vi`` the rule picks (bool array), or None for all of them."""
    if not rule.picks_elements:
        return None
    sel = np.ones(vi.shape, dtype=bool)
    for word, fraction in rule.slices:
        sel &= fraction_mask(word, fraction, vi.shape, vi.owner, _where(i, rule, vi))
    if rule.index is not None:
        sel &= rule.index.mask(vi.shape, _where(i, rule, vi))
    if rule.mask is not None:
        key = (i, vi.shape)
        if cache is None or key not in cache:
            got = _broadcast(i, rule, vi, np.asarray(rule.mask), "mask")
            if cache is None:
                cache = {}
            cache[key] = got
        sel &= cache[key]
    if rule.indices is not None:
        pick = np.zeros(vi.shape, dtype=bool)
        for t in rule.indices:
            if len(t) != len(vi.shape):
                raise PlanError(
                    f"{_where(i, rule, vi)}: index {t} has {len(t)} entries but the "
                    f"variable has {len(vi.shape)} axes; give one integer per axis."
                )
            for ax, (k, dim) in enumerate(zip(t, vi.shape)):
                if not -dim <= k < dim:
                    raise PlanError(
                        f"{_where(i, rule, vi)}: index {t} is out of range on axis {ax} "
                        f"(size {dim}); fix the index for shape {vi.shape}."
                    )
            pick[t] = True
        sel &= pick
    if rule.where is not None:
        value = np.asarray(vi.numpy())
        try:
            got = rule.where(value)
        except Exception as e:
            raise PlanError(
                f"{_where(i, rule, vi)}: where= raised {type(e).__name__}: {e}; it takes "
                "the variable's numpy value and returns a bool array."
            ) from None
        got = np.asarray(got)
        if got.dtype != np.bool_:
            raise PlanError(
                f"{_where(i, rule, vi)}: where= returned dtype {got.dtype} with shape "
                f"{got.shape}; it must return a bool array (e.g. `lambda w: w == 0`)."
            )
        if got.shape != tuple(vi.shape):  # a predicate on the value has its shape: anything else is a mistake
            raise PlanError(
                f"{_where(i, rule, vi)}: where= returned shape {got.shape}, not the variable's shape "
                f"{tuple(vi.shape)}; return one bool per element (e.g. `lambda w: np.abs(w) > 0.1`), or use "
                "mask= for a pattern that broadcasts."
            )
        sel &= got
    return sel


def resolve(plan: Plan, target: Target, *, selecting: bool = False) -> Resolution:
    """Resolve ``plan`` against ``target``.

    ``selecting``: the plan only names elements (``select``'s ``include`` and
    ``exclude``), it trains nothing: a quantized kernel may be named whole.

    Raises:
        PlanError: a rule selects nothing (strict), element pickers do not fit,
            a quantized kernel would train whole, or nothing is left to train.
    """
    rules = plan.all_rules  # the plan's rules, then the one its batchnorm option adds
    n_rules = len(rules)
    hits = [0] * n_rules
    freezes = np.array([False] + [r.freezes for r in rules])  # index 0 = Keras state
    scales = np.array([1.0] + [r.lr_scale if r.lr_scale is not None else 1.0 for r in rules])
    states = []
    untrained_hits: list[list[str]] = [[] for _ in rules]
    overwritten_hits: list[list[str]] = [[] for _ in rules]
    masks: dict = {}  # a rule's mask= broadcast to a shape, computed once
    for vi, matching in zip(target.variables, _matching(rules, target)):
        if not vi.base_trainable:
            for i in matching:
                untrained_hits[i].append(vi.path)
            states.append(VarState(vi, UNTRAINED, None, ((-1, vi.size),)))
            continue
        if vi.overwritten:  # a statistic of its layer (float8's): rules pass over it, its layer decides
            for i in matching:
                overwritten_hits[i].append(vi.path)
            states.append(VarState(vi, UNTRAINED, None, ((-1, vi.size),)))
            continue
        uniform = -1  # index into rules, -1 = Keras state
        dec = None  # per-element decider array (rule index + 1), when needed
        for i in matching:
            sel = _element_selection(i, rules[i], vi, masks)
            if sel is None:
                uniform, dec = i, None
                hits[i] += 1
                continue
            if not sel.any():
                continue
            hits[i] += 1
            if sel.all():
                uniform, dec = i, None
                continue
            if dec is None:
                dec = np.full(vi.shape, uniform + 1, dtype=np.int16 if n_rules < 32000 else np.int32)
            dec[sel] = i + 1
        # no rule: Keras' state, which is frozen for a variable a library switched off (LoRA's base kernel)
        states.append(_state(vi, uniform, dec, _off(freezes) if vi.switched_off else freezes, scales))
        if vi.quantized is not None and states[-1].state == TRAINABLE and not selecting:
            raise PlanError(
                f"the plan trains every element of {vi.path!r}, an {vi.quantized}-quantized kernel of logical shape "
                f"{vi.shape}: its float delta would be as large as the float kernel. Train a part of it (rows=, "
                f"columns=, heads=, an index, a mask or select), freeze it (ff.freeze({vi.path!r}) after broader "
                "train rules), or train LoRA on it."
            )
    _check_hits(plan, target, hits, untrained_hits, overwritten_hits)
    if not any(s.state in (TRAINABLE, PARTIAL) for s in states):
        raise PlanError(
            f"the plan {plan!r} leaves nothing to train in this "
            f"{target.kind} target ({len(states)} variables); add a train(...) rule "
            "or narrow a freeze(...) rule."
        )
    if not selecting:
        states = _follow_layers(states)
    frozen_bn = () if plan.batchnorm == "stats" else _frozen_bn_layers(target, states)
    return Resolution(plan, target, tuple(states), frozen_bn)


def _matching(rules, target) -> list[list[int]]:
    """For each variable of ``target``, the indices of the rules whose selector matches it, in order."""
    matches = [match_all(r.selector, target) for r in rules]
    if any(m is None for m in matches):
        return [
            [
                i
                for i, r in enumerate(rules)
                if (r.selector.matches(vi, target) if matches[i] is None else n in matches[i])
            ]
            for n, vi in enumerate(target.variables)
        ]
    per_var: list[list[int]] = [[] for _ in target.variables]
    for i, m in enumerate(matches):
        for n in m:
            per_var[n].append(i)
    return per_var


def _off(freezes: np.ndarray) -> np.ndarray:
    out = freezes.copy()
    out[0] = True
    return out


def _state(vi, uniform, dec, freezes, scales) -> VarState:
    if dec is None:
        frozen = bool(freezes[uniform + 1])
        return VarState(
            vi,
            FROZEN if frozen else TRAINABLE,
            None,
            ((uniform, vi.size),),
            lr_scale=float(scales[uniform + 1]),
        )
    counts = np.bincount(dec.reshape(-1), minlength=len(freezes))
    decided = tuple((int(k) - 1, int(counts[k])) for k in np.flatnonzero(counts))
    frozen = freezes[dec]
    n_frozen = int(np.count_nonzero(frozen))
    train_scales = {float(scales[k + 1]) for k, _ in decided if not freezes[k + 1]}
    lr_scale = train_scales.pop() if len(train_scales) == 1 else 1.0
    lr_scales = None
    if len(train_scales) >= 1:  # more than one distinct scale among trainables
        lr_scales = np.where(frozen, 0.0, scales[dec]).astype(np.float32)
    if n_frozen == 0:
        return VarState(vi, TRAINABLE, None, decided, lr_scale, lr_scales)
    if n_frozen == vi.size:
        return VarState(vi, FROZEN, None, decided)
    return VarState(vi, PARTIAL, ElementMask.from_dense(frozen), decided, lr_scale, lr_scales)


def _follow_layers(states: list[VarState]) -> list[VarState]:
    """Statistics Keras overwrites (float8's scales and amax histories) take their layer's state.

    Keras writes each step's new value into them through the optimizer (their
    "gradient", ``overwrite_with_gradient``), as it updates a layer's moving
    statistics in the forward pass: they are how the layer computes, not
    weights. Where any other variable of their layer trains (any element),
    they train whole, as in plain Keras; where none does, they stay fixed and
    ``verify`` covers them, as ``layer.trainable = False`` keeps them.
    """
    training = {id(s.info.owner) for s in states if s.state in (TRAINABLE, PARTIAL) and s.info.owner is not None}
    return [
        dataclasses.replace(
            s, state=TRAINABLE if id(s.info.owner) in training else FROZEN, decided_by=((FOLLOWS_LAYER, s.info.size),)
        )
        if s.info.overwritten and s.info.base_trainable
        else s
        for s in states
    ]


def _check_hits(plan, target, hits, untrained_hits, overwritten_hits):
    paths = [p for vi in target.variables for p in vi.names]
    for i, (rule, n) in enumerate(zip(plan.rules, hits)):
        if n:
            continue
        text = str(rule.selector.to_json()) if hasattr(rule.selector, "pattern") else repr(rule.selector)
        if overwritten_hits[i]:
            why = (
                f"it matches only statistics Keras overwrites at each step "
                f"({', '.join(overwritten_hits[i][:3])}: float8's scales and amax histories); those follow "
                "their layer: they train while anything of it trains, and stay fixed when all of it is frozen"
            )
        elif untrained_hits[i]:
            why = (
                f"it matches only variables Keras does not train "
                f"({', '.join(untrained_hits[i][:3])}); those stay outside plans"
            ) + quantization_note(target, untrained_hits[i])
        elif rule.picks_elements and any(rule.selector.matches(vi, target) for vi in target.variables):
            why = "it matches variables but zero of their elements"
        else:
            why = "no variable path matches it"
            pattern = getattr(rule.selector, "pattern", None)
            if not isinstance(pattern, str):  # a variable given itself: its path
                pattern = getattr(getattr(rule.selector, "variable", None), "path", None)
            if isinstance(pattern, str):
                why += standin_note(pattern, [vi.variable for vi in target.variables])
            regex = getattr(rule.selector, "regex", None)
            if regex is not None and target.ambiguous:
                why += ambiguity_note(regex, target.ambiguous).rstrip(".").replace(" The scoped", "; the scoped", 1)
        msg = (
            f"rule {i + 1} {rule!r} selects nothing: {why}. Closest existing "
            f"paths: {', '.join(closest(text, paths))}. Fix the selector, or "
            "use Plan(..., strict=False) to allow rules that select nothing."
        )
        if plan.strict:
            raise PlanError(msg)
        warnings.warn(msg, FreezeWarning, stacklevel=4)


def _frozen_bn_layers(target: Target, states) -> tuple:
    if target.kind != "keras":
        return ()
    import keras

    by_id = {id(s.info.variable): s for s in states}
    out = []
    for layer in target.layers:
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        own = [by_id.get(id(v)) for v in layer.weights]
        trained = [s for s in own if s is not None and s.state != UNTRAINED]
        if trained and all(s.state == FROZEN for s in trained):
            out.append(layer)
    return tuple(out)
