"""A delta file in memory: one entry per variable, and the checks that bind it to a model.

An :class:`Entry` is what a delta says of one variable: the flat indices it
writes (``None``: the whole variable) and their values, and the checks the
base must pass first (each the digest of the base with some trained
elements zeroed). :func:`read_entries` turns a checked file into entries,
:func:`bind` checks entries against a model and pairs each with its
variable, :func:`encode` turns entries back into the tensors and metadata
of a file. Nothing here writes a variable.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from finefreeze._backends.read import read
from finefreeze._errors import DeltaError, PlanError
from finefreeze._files import deltafile
from finefreeze._keras.quantized import FLOAT8_STATISTICS
from finefreeze._resolve.fingerprint import block_hashes
from finefreeze._resolve.targets import collect, match_path
from finefreeze._slices.held import delta_elements, delta_values, foreign_delta, hold_delta

__all__ = ["Entry", "Bound", "digest", "read_entries", "bind", "encode"]

_EMPTY = np.zeros(0, np.int64)


def digest(value: np.ndarray, trained: np.ndarray | None) -> str:
    """The digest of ``value`` with the elements at flat indices ``trained`` zeroed (None or empty: none)."""
    frozen = None
    if trained is not None and trained.size:
        frozen = np.ones(value.size, bool)
        frozen[trained] = False
        frozen = frozen.reshape(value.shape)
    return hashlib.blake2b(block_hashes(value, frozen).tobytes(), digest_size=16).hexdigest()


@dataclasses.dataclass(eq=False)
class Entry:
    """What a delta holds for one variable.

    ``index``: sorted flat indices of the written elements, or None for the
    whole variable; ``values``: their new values (None when nothing is
    written); ``checks``: ``(trained, digest)`` pairs, each a condition on
    the base (its digest with the flat indices ``trained`` zeroed).
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype
    index: np.ndarray | None
    values: np.ndarray | None
    checks: list[tuple[np.ndarray, str]]
    # trained on a quantized base: the mode (int8, int4); ``values`` are then the kernel's float delta at
    # ``index`` (its logical shape), and the checks digest its stored integers whole
    quantized: str | None = None

    @property
    def elements(self) -> int:
        """How many elements this entry writes."""
        return 0 if self.values is None else int(self.values.size)

    def trained(self) -> np.ndarray:
        """The flat indices this entry writes (every index for a whole variable)."""
        if self.values is None:
            return _EMPTY
        if self.index is None:
            return np.arange(int(np.prod(self.shape, dtype=np.int64)))
        return self.index


def read_entries(path: str) -> dict[str, Entry]:
    """The entries of the delta file at ``path``, every byte checked (:func:`deltafile.read`)."""
    variables, tensors = deltafile.read(path)
    out = {}
    for p, info in variables.items():
        try:
            out[p] = _entry(p, info, tensors)
        except DeltaError as e:
            raise DeltaError(f"delta {path!r}: {e}") from None
    return out


def _entry(p: str, info: dict, tensors: dict) -> Entry:
    shape, dtype = tuple(int(n) for n in info["shape"]), np.dtype(info["dtype"])
    size, kind, quantized = int(np.prod(shape, dtype=np.int64)), info["kind"], info.get("quantized")
    index = values = None
    if kind in ("trainable", "untrained"):
        values = tensors[p]
        if values.dtype != dtype or values.shape != shape:
            raise DeltaError(f"tensor {p!r} is {values.dtype} {values.shape}, its variable {dtype} {shape}.")
    elif kind == "partial":
        index = deltafile.decode_index(p, tensors, size)
        values = tensors[f"{p}::values"]
        if values.dtype != dtype or values.shape != index.shape:
            raise DeltaError(
                f"tensor {p + '::values'!r} is {values.dtype} {values.shape} but {p!r} needs "
                f"{dtype} ({index.size},) for its {index.size} trainable elements."
            )
    if "checks" in info:
        checks = [
            (deltafile.decode_index(c["trained"], tensors, size) if c.get("trained") else _EMPTY, str(c["frozen"]))
            for c in info["checks"]
        ]
    elif kind == "partial" and quantized is None:
        checks = [(index, str(info["frozen"]))]
    elif kind in ("frozen", "partial"):  # a quantized kernel: its integers, every one
        checks = [(_EMPTY, str(info["frozen"]))]
    else:
        checks = []
    return Entry(p, kind, shape, dtype, index, values, checks, None if quantized is None else str(quantized))


@dataclasses.dataclass(eq=False)
class Bound:
    """An entry paired with the model variable it writes."""

    entry: Entry
    variable: Any


def _renamed_root(path: str, by_path: dict) -> str:
    """A hint when ``path`` is in the base under another first name (Keras numbers unnamed models), or ""."""
    head, sep, rest = path.partition("/")
    other = next((k for k in by_path if sep and k.partition("/")[2] == rest and k.partition("/")[0] != head), None)
    if other is None:
        return ""
    here = other.partition("/")[0]
    return (
        f" The base has {other!r}: the model is named {here!r} here and was {head!r} where the delta was saved "
        "(Keras numbers models it names itself: sequential, sequential_1, ...). Give both the same name "
        "(keras.Sequential(..., name=...) or keras.Model(..., name=...))."
    )


def bind(target: Any, entries: dict[str, Entry], source: str) -> list[Bound]:
    """Check ``entries`` against ``target``'s variables as they are now; the entries that write, bound.

    Raises:
        DeltaError: a variable missing from ``target`` or of another shape or
            dtype, or a base that fails a check (its frozen part differs from
            the base the delta was trained on). Nothing is written.
    """
    try:
        t = collect(target)
    except PlanError as e:
        raise DeltaError(str(e)) from None
    by_path = {n: vi for vi in t.variables for n in vi.names}
    bound = []
    for p, e in entries.items():
        try:
            vi = match_path(p, by_path)
        except PlanError as err:
            raise DeltaError(f"{source}: {err}") from None
        if vi is None:
            hint = (
                " The delta was made on a model Keras quantized to float8 (this is one of its scales or amax "
                "histories): quantize this base the same way (model.quantize('float8')) first."
                if p.rsplit("/", 1)[-1] in FLOAT8_STATISTICS
                else _renamed_root(p, by_path)
            )
            raise DeltaError(f"{source}: the base has no variable {p!r} (shape {e.shape}).{hint}")
        shape, dtype = tuple(vi.shape), vi.dtype
        if vi.quantized != e.quantized:
            raise DeltaError(f"{source}: {quantized_mismatch(p, vi.quantized, e.quantized)}")
        if shape != e.shape or np.dtype(dtype) != e.dtype:
            raise DeltaError(
                f"{source}: variable {p!r} is {shape} {dtype} in the base but {e.shape} {e.dtype} in the delta."
            )
        if e.checks:
            base = read(vi.variable)  # a view of the buffer where the backend allows: no copy of the model
            for trained, want in e.checks:
                if digest(base, trained) != want:
                    raise DeltaError(
                        f"{source}: the frozen part of {p!r} (shape {e.shape}) differs from the base the "
                        "delta was trained on (fingerprint mismatch); apply it to that base."
                    )
        if e.quantized is not None:
            _refuse_other_delta(source, p, vi, e)
        if e.quantized is not None and e.values is not None and foreign_delta(vi.owner, vi.variable, e.index):
            raise DeltaError(
                f"{source}: a live Freezer trains other elements of the float delta of {p!r} (it is quantized), and "
                "its optimizer holds their state: load the delta into a base no Freezer trains (or make the Freezer "
                "after loading it, with a plan that trains these elements too)."
            )
        if e.values is not None:
            bound.append(Bound(e, vi.variable) if e.quantized is None else QuantizedBound(e, vi.owner, vi.variable))
    return bound


def _refuse_other_delta(source: str, p: str, vi, e: Entry) -> None:
    """Raise when ``vi``'s quantized kernel holds a float delta of values at elements ``e`` leaves frozen.

    Its integers match the file's digest whatever the delta beside them, so
    this is the check a float kernel's frozen part gets from its digest: the
    model is another delta's, not the base this one was trained on.
    """
    held = delta_values(vi.owner, vi.variable)
    if held is None:
        return
    index, values = held
    trained = e.index if e.kind == "partial" and e.index is not None else np.zeros(0, np.int64)
    other = index[(values != 0) & ~np.isin(index, trained)]
    if other.size:
        raise DeltaError(
            f"{source}: {p!r} (shape {e.shape}, {e.quantized}-quantized) holds a float delta of trained values at "
            f"{other.size} element(s) this delta leaves frozen (first flat index {int(other[0])}): the model is not "
            "the base the delta was trained on, and the two would add up. Apply it to the quantized base alone (a "
            "fresh model quantized the same way, or after DeltaSwitch.use(None)); to combine deltas of disjoint "
            "elements, merge_deltas them into one file first."
        )


def quantized_mismatch(path: str, base: str | None, delta: str | None) -> str:
    """Why a delta of a quantized (or float) kernel does not apply to a float (or quantized) one, and the fix."""
    if delta is None:
        return (
            f"{path!r} is an {base}-quantized kernel in the base, and the delta was trained on its float values: a "
            "delta cannot write float values into integers. Apply the delta to the float model, then quantize() it."
        )
    if base is None:
        return (
            f"the delta was made on a base whose {path!r} is {delta}-quantized, and this base holds it in float: a "
            "quantized kernel's trained values are a float delta to its integers. Quantize the base the same way "
            f"first (model.quantize({delta!r})), then apply it."
        )
    return f"{path!r} is {base}-quantized in the base but was {delta}-quantized when the delta was trained."


class QuantizedBound:
    """An entry of a quantized kernel, written into the kernel's float delta (made or widened on first use).

    ``variable`` is the delta (:func:`finefreeze._slices.held.hold_delta`) and
    ``entry`` the file's entry with its indices as places in the delta.
    """

    def __init__(self, entry: Entry, layer, kernel):
        self._entry, self.layer, self.kernel = entry, layer, kernel

    @property
    def logical(self) -> np.ndarray:
        """The flat indices of the entry's elements in the kernel's logical shape."""
        return self._entry.index

    @property
    def variable(self):
        return hold_delta(self.layer, self.kernel, self._entry.index)

    @property
    def entry(self) -> Entry:
        have = delta_elements(self.layer, self.kernel)
        places = np.arange(self._entry.index.size) if have is None else np.searchsorted(have, self._entry.index)
        return dataclasses.replace(self._entry, index=places.astype(np.int64))


def encode(entries: dict[str, Entry]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The tensors and ``variables`` metadata of a file holding ``entries``."""
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, dict] = {}
    for p, e in entries.items():
        info: dict[str, Any] = {"shape": list(e.shape), "dtype": str(e.dtype), "kind": e.kind}
        if e.quantized is not None:
            info["quantized"] = e.quantized
        if e.kind in ("trainable", "untrained"):
            tensors[p] = e.values
        elif e.kind == "partial":
            tensors.update(deltafile.encode_index(p, e.index))
            tensors[f"{p}::values"] = e.values
        own = {"partial": e.index if e.quantized is None else _EMPTY, "frozen": _EMPTY}.get(e.kind)  # "frozen" checks
        if len(e.checks) == 1 and own is not None and np.array_equal(e.checks[0][0], own):
            info["frozen"] = e.checks[0][1]  # the check of its own trained elements
        elif e.checks or e.kind in ("partial", "frozen"):
            info["checks"] = []
            for k, (trained, d) in enumerate(e.checks):
                c = {"frozen": d}
                if trained.size:
                    c["trained"] = f"{p}::check{k}"
                    tensors.update(deltafile.encode_index(c["trained"], trained))
                info["checks"].append(c)
        meta[p] = info
    return tensors, meta
