"""Rules: ``freeze(...)`` and ``train(...)``, parsed once into immutable values."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from finefreeze._errors import PlanError
from finefreeze._plan.index import IndexSpec, parse_index
from finefreeze._plan.packed import PackedMask, encode_mask
from finefreeze._plan.selectors import Selector, to_selector

__all__ = ["Rule", "freeze", "train"]


@dataclasses.dataclass(frozen=True, eq=False)
class Rule:
    """One line of a plan: an action applied to what a selector picks.

    Build rules with :func:`freeze` and :func:`train`; ``repr(rule)`` reads
    like the line that made it.

    Example:
        >>> import finefreeze as ff
        >>> rule = ff.freeze("encoder/**")
        >>> rule.action, rule.to_dict()
        ('freeze', {'freeze': 'encoder/**'})
    """

    action: str  # "freeze" | "train"
    selector: Selector
    index: IndexSpec | None = None
    mask: PackedMask | None = None  #: the ``mask=`` given, packed; ``np.asarray(rule.mask)`` reads it
    indices: tuple[tuple[int, ...], ...] | None = None
    where: Callable | None = None
    lr_scale: float | None = None
    #: ``(("columns", 0.01),)``: the first fraction of each matched variable's slices along the word's axis
    slices: tuple[tuple[str, float], ...] = ()

    @property
    def freezes(self) -> bool:
        return self.action == "freeze"

    @property
    def picks_elements(self) -> bool:
        return bool(self.slices) or any(x is not None for x in (self.index, self.mask, self.indices, self.where))

    def __repr__(self) -> str:
        first = repr(self.selector)
        if self.index is not None:
            first = repr(f"{self.selector.to_json()}{self.index.text}")
        args = [first]
        if self.mask is not None:
            args.append(f"mask=<bool {self.mask.shape}>")
        if self.indices is not None:
            args.append(f"indices={[list(t) for t in self.indices]}")
        if self.where is not None:
            args.append(f"where={getattr(self.where, '__name__', 'callable')}")
        args += [f"{word}={value!r}" for word, value in self.slices]
        if self.lr_scale is not None:
            args.append(f"lr_scale={self.lr_scale}")
        return f"{self.action}({', '.join(args)})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, Rule):
            return NotImplemented
        try:
            return self.to_dict() == other.to_dict()
        except PlanError:
            return self is other

    def __hash__(self):
        return hash(repr(self))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, as written in plan files.

        Raises:
            PlanError: the rule holds a callable, an instance or a variable.
        """
        sel = self.selector.to_json()
        if self.index is not None:
            sel = f"{sel}{self.index.text}"
        d: dict[str, Any] = {self.action: sel}
        if self.mask is not None:
            d["mask"] = encode_mask(self.mask)
        if self.indices is not None:
            d["indices"] = [list(t) for t in self.indices]
        if self.where is not None:
            raise PlanError(
                f"rule {self!r}: a where= callable cannot be written to a plan "
                "file. The resolved masks persist with the optimizer and in delta "
                "files; for a plan file, use mask= or indices=."
            )
        d.update(self.slices)
        if self.lr_scale is not None:
            d["lr_scale"] = self.lr_scale
        return d


_FRACTION_RULE = 'a fraction of the slices: a float in (0, 1] or a percent such as "1%"'
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")


def _fraction(action, selector, word, value) -> float:
    """``value`` of ``rows=`` / ``columns=`` / ``heads=`` as a float in (0, 1]."""
    said = f"{action}({selector!r}, {word}={value!r})"
    if isinstance(value, str):
        m = _PERCENT.fullmatch(value)
        if m is not None and 0 < Decimal(m.group(1)) <= 100:
            return float(Decimal(m.group(1)) / 100)
        raise PlanError(f"{said}: not a percent in (0, 100]; {word}= is {_FRACTION_RULE}.")
    if isinstance(value, (bool, np.bool_)):
        raise PlanError(f"{said}: {word}= is {_FRACTION_RULE}, not a bool.")
    if isinstance(value, (int, np.integer)):
        raise PlanError(
            f"{said}: {word}= is {_FRACTION_RULE}, not a count; for the first {value} {word} of one variable "
            f"write an index suffix such as '[:{value}]' (rows) or '[..., :{value}]' (columns)."
        )
    if isinstance(value, (float, np.floating)) and 0 < value <= 1:
        return float(value)
    hint = f' For {value:g} % write {word}="{value:g}%".' if isinstance(value, float) and 1 < value <= 100 else ""
    raise PlanError(f"{said}: {word}= is {_FRACTION_RULE}.{hint}")


def _make(action, selector, mask, indices, where, lr_scale, slices=None) -> Rule:
    sel, suffix = to_selector(selector)
    index = None
    if suffix is not None:
        index = parse_index(suffix, selector, len(selector) - len(suffix))
    if mask is not None and not isinstance(mask, PackedMask):  # a plan file's comes checked and packed
        mask_arr = np.asarray(mask)
        if mask_arr.dtype != np.bool_:
            raise PlanError(
                f"{action}({selector!r}, mask=...): mask has dtype {mask_arr.dtype}, "
                f"shape {mask_arr.shape}; it must be a bool array (True = selected). "
                "Convert with mask.astype(bool)."
            )
        mask = PackedMask(mask_arr)  # a copy, one bit per element
    if indices is not None:
        indices = _norm_indices(action, selector, indices)
    if where is not None and not callable(where):
        raise PlanError(
            f"{action}({selector!r}, where=...): where must be a callable taking "
            f"the variable's numpy value and returning a bool array; got {type(where).__name__}."
        )
    if lr_scale is not None:
        if (
            isinstance(lr_scale, bool)
            or not isinstance(lr_scale, (int, float))
            or not math.isfinite(lr_scale)
            or lr_scale < 0
        ):
            raise PlanError(f"train({selector!r}, lr_scale={lr_scale!r}): lr_scale must be a finite number > 0.")
        if lr_scale == 0:
            raise PlanError(
                f"train({selector!r}, lr_scale=0): a step scaled by 0 never moves, yet the elements would "
                "count as trained (gradients, optimizer state, no verify()). To keep them fixed, "
                f"freeze them: ff.freeze({selector!r})."
            )
        lr_scale = float(lr_scale)
    fractions = tuple(
        (word, _fraction(action, selector, word, value)) for word, value in (slices or {}).items() if value is not None
    )
    return Rule(action, sel, index, mask, indices, where, lr_scale, fractions)


def _integer(i) -> int:
    """``i`` as an int, for a Python or numpy integer only (a float or a string is a mistake, not an index)."""
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        raise TypeError(i)
    return int(i)


def _norm_indices(action, selector, indices) -> tuple[tuple[int, ...], ...]:
    if isinstance(indices, np.ndarray) and indices.ndim == 2:  # np.argwhere's rows
        indices = indices.tolist()
    try:
        out = tuple(
            tuple(_integer(i) for i in (t if isinstance(t, (tuple, list, np.ndarray)) else (t,))) for t in indices
        )
    except (TypeError, ValueError):
        raise PlanError(
            f"{action}({selector!r}, indices=...): indices must be a list of integer "
            f"tuples, one per element, e.g. [(0, 0), (1, 1)]; got {indices!r}."
        ) from None
    if not out:
        raise PlanError(f"{action}({selector!r}, indices=[]): the index list is empty.")
    return out


def freeze(
    selector: Any = None,
    *,
    mask: np.ndarray | None = None,
    indices: Sequence[Sequence[int]] | None = None,
    where: Callable[[np.ndarray], np.ndarray] | None = None,
    rows: float | str | None = None,
    columns: float | str | None = None,
    heads: float | str | None = None,
) -> Rule:
    """A rule that freezes what ``selector`` (and the element pickers) select.

    Args:
        selector: a path glob (``"encoder/**"``, optionally with an index
            suffix ``"emb/embeddings[:1000]"``), ``"re:<regex>"``, a layer
            class, a layer or ``tf.Module`` instance, a variable, or a callable
            ``(path, variable) -> bool``. ``None`` selects every variable.
        mask: bool array broadcastable to the variable's shape (True = pick).
        indices: list of index tuples, one per picked element.
        where: callable on the variable's numpy value returning a bool array.
            Evaluated once, when the plan is resolved.
        rows: pick the first fraction of each selected variable's rows (its
            first axis): a float in (0, 1] or a percent such as ``"1%"``;
            rounded half up, at least one row.
        columns: the same along the last axis (a ``Dense`` kernel's output
            units, a q/k/v kernel's head features).
        heads: the same along the heads axis of an attention projection's
            three-axis ``EinsumDense`` kernel (docs/selectors.md has the axis
            of each word per layer kind).

    Element pickers combine: an element is picked where every one given picks it.

    Returns:
        An immutable :class:`Rule`.

    Raises:
        PlanError: bad glob, regex or index syntax, non-bool mask, bad indices,
            a fraction outside (0, 1] or not a float or percent; at resolution,
            ``heads=`` on a variable with no heads axis.

    Example:
        >>> import finefreeze as ff
        >>> ff.freeze("encoder/**")
        freeze('encoder/**')
        >>> ff.freeze("emb/embeddings[:1000]")
        freeze('emb/embeddings[:1000]')
        >>> ff.freeze("**/kernel", rows="50%")
        freeze('**/kernel', rows=0.5)
    """
    return _make("freeze", selector, mask, indices, where, None, dict(rows=rows, columns=columns, heads=heads))


def train(
    selector: Any = None,
    *,
    mask: np.ndarray | None = None,
    indices: Sequence[Sequence[int]] | None = None,
    where: Callable[[np.ndarray], np.ndarray] | None = None,
    lr_scale: float | None = None,
    rows: float | str | None = None,
    columns: float | str | None = None,
    heads: float | str | None = None,
) -> Rule:
    """A rule that makes what ``selector`` selects trainable.

    Takes the same selectors as :func:`freeze`. Only variables Keras would
    train can be trained: moving statistics stay outside plans.

    Args:
        selector: see :func:`freeze`.
        mask: see :func:`freeze`.
        indices: see :func:`freeze`.
        where: see :func:`freeze`.
        rows: see :func:`freeze`.
        columns: see :func:`freeze`.
        heads: see :func:`freeze`.
        lr_scale: multiplies the selected elements' whole optimizer step
            (weight decay included); ``None`` means 1.

    Returns:
        An immutable :class:`Rule`.

    Raises:
        PlanError: as :func:`freeze`, or an ``lr_scale`` that is 0 (use :func:`freeze`), negative or not finite.

    Example:
        >>> import finefreeze as ff
        >>> ff.train("head/**", lr_scale=0.1)
        train('head/**', lr_scale=0.1)
        >>> ff.train("**/attention/**/kernel", columns="1%")  # the first 1 % of each kernel's columns
        train('**/attention/**/kernel', columns=0.01)
    """
    return _make("train", selector, mask, indices, where, lr_scale, dict(rows=rows, columns=columns, heads=heads))
