"""Rules: ``freeze(...)`` and ``train(...)``, parsed once into immutable values."""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import zlib
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import numpy as np

from finefreeze._errors import PlanError
from finefreeze._plan.index import IndexSpec, parse_index
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


PACKED_MASK_AT = 64  #: masks with more elements are written packed, 1 bit per element


class PackedMask:
    """A rule's bool mask, held at one bit per element: ``np.asarray(mask)`` gives the bool array.

    A plan lives as long as its ``Freezer``: a mask of random elements over
    every kernel of a 150 M-parameter model held as bools would cost 150 MB
    for the whole run; packed it costs 19 MB. Reading it unpacks a fresh,
    read-only copy (a plan is resolved once per change, not per step).

    Args:
        mask: the bool array.

    Example:
        >>> import numpy as np
        >>> m = PackedMask(np.eye(3, dtype=bool))
        >>> m.shape, int(np.asarray(m).sum())
        ((3, 3), 3)
    """

    __slots__ = ("_bits", "shape")
    dtype = np.dtype(np.bool_)

    def __init__(self, mask: np.ndarray):
        self._hold(np.shape(mask), np.packbits(np.asarray(mask, dtype=np.bool_).reshape(-1)))

    def _hold(self, shape, bits: np.ndarray) -> None:
        self.shape = tuple(int(n) for n in shape)
        self._bits = np.asarray(bits, dtype=np.uint8)
        self._bits.setflags(write=False)

    @classmethod
    def from_bits(cls, bits: np.ndarray, shape) -> PackedMask:
        """The mask of ``np.packbits`` output ``bits`` (C order) for ``shape``, taken as it is (a plan file's)."""
        out = cls.__new__(cls)
        out._hold(shape, bits)
        return out

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self._bits.nbytes)

    @property
    def bits(self) -> np.ndarray:
        """The packed bits (``np.packbits`` of the flattened mask, C order)."""
        return self._bits

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.unpackbits(self._bits, count=self.size).view(np.bool_).reshape(self.shape)
        if dtype is not None and np.dtype(dtype) != np.bool_:
            out = out.astype(dtype)
        out.setflags(write=False)
        return out

    def __getitem__(self, key):
        return np.asarray(self)[key]

    def sum(self, *args, **kwargs):
        """The number of True elements (``np.sum`` of the bools; same arguments)."""
        return np.asarray(self).sum(*args, **kwargs)

    def any(self, *args, **kwargs):
        return np.asarray(self).any(*args, **kwargs)

    def all(self, *args, **kwargs):
        return np.asarray(self).all(*args, **kwargs)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d mask")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"PackedMask(shape={self.shape})"


def encode_mask(mask: PackedMask):
    """A mask as plan files write it: nested bool lists, or ``{"shape", "packbits"}`` when large.

    Large masks (from ``ff.select``, say) would otherwise cost about 6 bytes
    of JSON per element; packed they cost 1/6 byte (base64 of ``np.packbits``).
    A sparse mask is written ``{"shape", "zpackbits"}``, its packed bits
    compressed with zlib first (a 0.1 % selection of a 23 M element model:
    2.7 MB packed, about 0.1 MB compressed).
    """
    if mask.size <= PACKED_MASK_AT:
        return np.asarray(mask).tolist()
    packed = mask.bits.tobytes()
    small = zlib.compress(packed, 9)
    if len(small) < len(packed) // 2:
        return {"shape": list(mask.shape), "zpackbits": base64.b64encode(small).decode("ascii")}
    return {"shape": list(mask.shape), "packbits": base64.b64encode(packed).decode("ascii")}


def decode_mask(value, where: str) -> PackedMask:
    """The mask of :func:`encode_mask`'s packed form, kept packed.

    Raises:
        PlanError: a malformed packed mask.
    """
    keys = set(value)
    if keys not in ({"shape", "packbits"}, {"shape", "zpackbits"}):
        raise PlanError(
            f"{where}: a packed mask has exactly 'shape' and 'packbits' (or 'zpackbits'); got keys {sorted(value)}."
        )
    shape = value["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise PlanError(f"{where}: packed mask shape must be a list of sizes, got {shape!r}.")
    key = "packbits" if "packbits" in keys else "zpackbits"
    try:
        data = base64.b64decode(value[key], validate=True)
        if key == "zpackbits":
            data = zlib.decompress(data)
        raw = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError, zlib.error) as e:
        raise PlanError(
            f"{where}: packed mask bits are not base64{' of zlib data' * (key == 'zpackbits')} ({e})."
        ) from None
    size = math.prod(shape)
    if len(raw) != -(-size // 8):
        raise PlanError(
            f"{where}: packed mask of shape {tuple(shape)} needs {-(-size // 8)} bytes, got {len(raw)}; "
            "write the mask again."
        )
    return PackedMask.from_bits(raw, shape)


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
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (int, np.integer)):
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
