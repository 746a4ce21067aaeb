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
from keras.backend import standardize_dtype as standardize

from finefreeze._backends.read import read
from finefreeze._errors import DeltaError, PlanError
from finefreeze._files import deltafile
from finefreeze._resolve.fingerprint import block_hashes
from finefreeze._resolve.targets import collect, match_path

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
    size, kind = int(np.prod(shape, dtype=np.int64)), info["kind"]
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
    elif kind == "partial":
        checks = [(index, str(info["frozen"]))]
    elif kind == "frozen":
        checks = [(_EMPTY, str(info["frozen"]))]
    else:
        checks = []
    return Entry(p, kind, shape, dtype, index, values, checks)


@dataclasses.dataclass(eq=False)
class Bound:
    """An entry paired with the model variable it writes."""

    entry: Entry
    variable: Any


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
            raise DeltaError(f"{source}: the base has no variable {p!r} (shape {e.shape}).")
        shape, dtype = tuple(vi.shape), vi.dtype
        if vi.quantized is not None:  # what the file holds of it: its stored integers
            shape, dtype = tuple(int(d) for d in vi.variable.shape), standardize(vi.variable.dtype)
            if e.values is not None or np.dtype(dtype) != e.dtype:
                raise DeltaError(
                    f"{source}: {p!r} is a {vi.quantized}-quantized kernel in the base (logical shape {vi.shape}), "
                    f"{e.dtype} {e.shape} in the delta: a delta cannot write float values into its integers. "
                    "Apply the delta to the float model, then quantize() it."
                )
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
        if e.values is not None:
            bound.append(Bound(e, vi.variable))
    return bound


def encode(entries: dict[str, Entry]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The tensors and ``variables`` metadata of a file holding ``entries``."""
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, dict] = {}
    for p, e in entries.items():
        info: dict[str, Any] = {"shape": list(e.shape), "dtype": str(e.dtype), "kind": e.kind}
        if e.kind in ("trainable", "untrained"):
            tensors[p] = e.values
        elif e.kind == "partial":
            tensors.update(deltafile.encode_index(p, e.index))
            tensors[f"{p}::values"] = e.values
        own = {"partial": e.index, "frozen": _EMPTY}.get(e.kind)  # what "frozen" checks
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
