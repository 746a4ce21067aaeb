"""Numpy-style element indexing written after a path: ``kernel[0:10, ::2]``.

A suffix is parsed once into an immutable :class:`IndexSpec`; applying it to a
shape gives one integer array per axis. At most one axis may be an integer
list: with two, numpy pairs the lists where an outer product would take
every combination, and a reader of the plan cannot tell which was meant, so
``kernel[[0, 1], [0, 1]]`` is a ``PlanError`` that shows both spellings
(``indices=[(0, 0), (1, 1)]`` for the pairs, a mask for the block).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from finefreeze._errors import PlanError

__all__ = ["IndexSpec", "parse_index", "split_suffix"]

_INT = re.compile(r"\s*([+-]?\d+)\s*")


@dataclasses.dataclass(frozen=True)
class IndexSpec:
    """Parsed index suffix: a tuple of per-axis items.

    Items are ``("int", i)``, ``("slice", start, stop, step)``,
    ``("list", (i, ...))`` or ``("ellipsis",)``.
    """

    items: tuple
    text: str

    def __str__(self) -> str:
        return self.text

    def axes(self, shape: tuple[int, ...], where: str) -> tuple[np.ndarray, ...]:
        """Return one int64 index array per axis of ``shape``.

        Args:
            shape: the variable's shape.
            where: context for error messages (rule and path).

        Raises:
            PlanError: too many indices, an index or slice bound out of range.
        """
        items = list(self.items)
        n_ell = sum(1 for it in items if it[0] == "ellipsis")
        n_real = len(items) - n_ell
        if n_real > len(shape):
            raise PlanError(
                f"{where}: index {self.text} has {n_real} indices but the "
                f"variable has shape {tuple(shape)} ({len(shape)} axes); "
                "drop indices or use '...'."
            )
        if n_ell:
            pos = next(i for i, it in enumerate(items) if it[0] == "ellipsis")
            items[pos : pos + 1] = [("slice", None, None, None)] * (len(shape) - n_real)
        items += [("slice", None, None, None)] * (len(shape) - len(items))
        out = []
        for axis, (item, dim) in enumerate(zip(items, shape)):
            out.append(_axis_indices(item, int(dim), axis, self.text, shape, where))
        return tuple(out)

    def mask(self, shape: tuple[int, ...], where: str) -> np.ndarray:
        """Dense boolean selection of ``shape`` (True = selected)."""
        axes = self.axes(shape, where)
        m = np.zeros(shape, dtype=bool)
        if all(len(a) for a in axes):
            m[np.ix_(*axes)] = True
        return m


def _bound_error(where, text, shape, axis, what):
    return PlanError(
        f"{where}: index {text} is out of range on axis {axis} of shape "
        f"{tuple(shape)}: {what}. Indices are checked, never clipped; fix the "
        "index for this variable's shape."
    )


def _axis_indices(item, dim, axis, text, shape, where) -> np.ndarray:
    kind = item[0]
    if kind == "int":
        i = item[1]
        if not -dim <= i < dim:
            raise _bound_error(where, text, shape, axis, f"{i} not in [{-dim}, {dim})")
        return np.array([i % dim], dtype=np.int64)
    if kind == "list":
        vals = np.array(item[1], dtype=np.int64)
        bad = [int(v) for v in vals if not -dim <= v < dim]
        if bad:
            raise _bound_error(where, text, shape, axis, f"{bad[0]} not in [{-dim}, {dim})")
        return np.unique(vals % dim) if len(vals) else vals
    _, start, stop, step = item
    for name, b in (("start", start), ("stop", stop)):
        if b is not None and not -dim <= b <= dim:
            raise _bound_error(where, text, shape, axis, f"slice {name} {b} beyond dimension {dim}")
    return np.arange(dim, dtype=np.int64)[slice(start, stop, step)]


def split_suffix(selector: str) -> tuple[str, str | None]:
    """Split ``'a/b[0:3]'`` into ``('a/b', '[0:3]')``; the first ``[`` starts it."""
    pos = selector.find("[")
    if pos < 0:
        return selector, None
    return selector[:pos], selector[pos:]


def parse_index(suffix: str, selector: str, offset: int) -> IndexSpec:
    """Parse ``[...]`` (``offset`` = its column in ``selector``) into a spec.

    Raises:
        PlanError: bad syntax, with a caret under the offending column.
    """
    p = _Parser(suffix, selector, offset)
    items = p.parse()
    lists = [it[1] for it in items if it[0] == "list"]
    if len(lists) > 1:
        raise _paired_lists(selector, suffix, items, lists)
    return IndexSpec(items, suffix)


def _paired_lists(selector: str, suffix: str, items, lists) -> PlanError:
    """The error for two integer lists in one suffix: numpy pairs them, an outer product would not."""
    base = selector[: len(selector) - len(suffix)] if selector.endswith(suffix) else selector
    same = len({len(v) for v in lists}) == 1
    if same and len(lists) == len(items):
        pairs = ", ".join(str(tuple(int(x) for x in t)) for t in zip(*lists))
        numpy = f"numpy would select the {len(lists[0])} elements {pairs} (pairs, one from each list)"
        fix = f"for those elements write ff.train({base!r}, indices=[{pairs}])"
    else:
        numpy = "numpy would pair the lists element by element (advanced indexing)"
        fix = "for single elements write indices=[(i, j, ...), ...]"
    ix = ", ".join(str(list(v)) for v in lists)
    return PlanError(
        f"selector {selector!r} has {len(lists)} integer lists in one index: {numpy}, while an outer "
        f"product would take every combination (a block). finefreeze does not guess: {fix}; for the "
        f"block write a mask: m = np.zeros(shape, bool); m[np.ix_({ix})] = True; "
        f"ff.train({base!r}, mask=m) (or slices such as [0:2, 0:2] where the indices are contiguous)."
    )


class _Parser:
    def __init__(self, s: str, selector: str, offset: int):
        self.s, self.selector, self.offset, self.i = s, selector, offset, 0

    def fail(self, what: str, at: int | None = None):
        col = self.offset + (self.i if at is None else at)
        raise PlanError(
            f"bad index syntax in selector {self.selector!r} at column {col + 1}: "
            f"{what}\n    {self.selector}\n    {' ' * col}^\n"
            "Write numpy basic indexing, e.g. 'emb/embeddings[1000:, :]', "
            "'kernel[[0, 5], ...]' or 'kernel[-1, ::2]'."
        )

    def peek(self) -> str:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def expect(self, ch: str):
        if self.peek() != ch:
            self.fail(f"expected {ch!r}, found {self.peek() or 'end of selector'!r}")
        self.i += 1

    def parse(self) -> tuple:
        self.expect("[")
        items = []
        if self.peek() == "]":
            self.fail("empty index '[]'; remove the brackets to select the whole variable")
        while True:
            items.append(self.item())
            c = self.peek()
            if c == ",":
                self.i += 1
                if self.peek() == "]":
                    break
                continue
            if c == "]":
                break
            self.fail(f"expected ',' or ']', found {c or 'end of selector'!r}")
        self.i += 1
        if self.peek():
            self.fail("text after the closing ']'")
        if sum(1 for it in items if it[0] == "ellipsis") > 1:
            self.fail("more than one '...'", at=self.s.rfind("..."))
        return tuple(items)

    def int_or_none(self):
        m = _INT.match(self.s, self.i)
        if not m:
            return None
        self.i = m.end()
        return int(m.group(1))

    def item(self):
        c = self.peek()
        if self.s.startswith("...", self.i):
            self.i += 3
            return ("ellipsis",)
        if c == "[":
            self.i += 1
            vals = []
            while self.peek() != "]":
                v = self.int_or_none()
                if v is None:
                    self.fail("expected an integer in the index list")
                vals.append(v)
                if self.peek() == ",":
                    self.i += 1
                elif self.peek() != "]":
                    self.fail(f"expected ',' or ']' in the index list, found {self.peek() or 'end'!r}")
            self.i += 1
            return ("list", tuple(vals))
        parts = [self.int_or_none()]
        n_colons = 0
        step_at = None
        while self.peek() == ":":
            n_colons += 1
            if n_colons > 2:
                self.fail("a slice has at most two ':'")
            self.i += 1
            step_at = self.i
            self.peek()
            if n_colons == 2:
                step_at = self.i
            parts.append(self.int_or_none())
        if n_colons == 0:
            if parts[0] is None:
                self.fail(f"expected an integer, a slice, a list or '...', found {self.peek() or 'end of selector'!r}")
            return ("int", parts[0])
        parts += [None] * (3 - len(parts))
        if parts[2] == 0:
            self.fail("slice step cannot be zero", at=step_at)
        return ("slice", parts[0], parts[1], parts[2])
