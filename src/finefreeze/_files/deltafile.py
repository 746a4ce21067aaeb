"""The delta file format (``finefreeze.delta/1``): safetensors whose metadata vouches for every byte.

Metadata entries (all strings, as safetensors requires):

- ``format``: ``finefreeze.delta/1``, the one format this version reads;
  ``finefreeze``: the writing version; ``plan``: the plan as JSON
  (informational);
- ``variables``: JSON ``{path: {shape, dtype, kind, frozen | checks}}``,
  ``kind`` one of ``trainable``, ``untrained``, ``partial``, ``frozen``;
  ``frozen`` is the digest of the variable's frozen part (see ``delta``);
  a delta written by ``merge_deltas`` may carry ``checks`` instead: a list
  of ``{"frozen": digest, "trained": key?}``, one per delta that was
  merged, each the digest of the base with that delta's trained elements
  (the indices stored under ``key::index`` or ``key::runs``; none: the
  whole variable) zeroed. Every check must hold on the base;
- ``base`` (optional): JSON naming what the delta was trained from (a
  KerasHub preset's path and sha256, the task built on it), so that the
  command line can rebuild that model;
- ``tensors``: JSON ``{key: {dtype, shape, sha256}}`` for every stored tensor
  (``path`` for whole variables, ``path::index`` or ``path::runs`` and
  ``path::values`` for partially frozen ones);
- ``checksum``: sha256 of the other entries, so damaged metadata is caught too.

Files are written by :func:`write` itself, not by safetensors' ``save``,
whose metadata order changes from process to process: the same delta is
the same bytes (metadata keys sorted, tensors by alignment then name).

:func:`read` checks all of it — header, metadata, keys, dtypes, shapes and
checksums, missing or extra tensors — and raises :class:`DeltaError` naming
the tensor before anyone writes a value.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from finefreeze._errors import DeltaError
from finefreeze._kinds import STATES
from finefreeze._version import __version__

__all__ = ["FORMAT", "write", "read", "read_json", "encode_index", "decode_index", "stored_keys"]

#: the ``format`` entry of every delta file; a file with any other is refused
FORMAT = "finefreeze.delta/1"
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _meta_checksum(meta: dict[str, str]) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def encode_index(p: str, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Flat indices as runs ``(start, length)`` or a plain list, whichever is smaller."""
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = idx[np.r_[0, breaks]]
    lengths = np.diff(np.r_[0, breaks, idx.size])
    dtype = np.int32 if idx.size == 0 or idx[-1] < 2**31 else np.int64
    if 2 * starts.size < idx.size:
        return {f"{p}::runs": np.stack([starts, lengths], axis=1).astype(dtype)}
    return {f"{p}::index": idx.astype(dtype)}


def decode_index(p: str, tensors: dict[str, np.ndarray], size: int) -> np.ndarray:
    """The sorted flat indices stored for ``p``; :class:`DeltaError` unless they fit ``size`` elements."""
    if f"{p}::runs" in tensors:
        runs = tensors[f"{p}::runs"].astype(np.int64)
        if runs.ndim != 2 or runs.shape[1] != 2 or (runs[:, 1] < 0).any():
            raise DeltaError(f"tensor {p + '::runs'!r}: runs must be (start, length) pairs, got shape {runs.shape}")
        idx = np.concatenate([np.arange(s, s + n) for s, n in runs]) if runs.size else np.zeros(0, np.int64)
    else:
        idx = tensors[f"{p}::index"].astype(np.int64)
    if idx.ndim != 1 or (idx.size and (idx[0] < 0 or idx[-1] >= size or (np.diff(idx) <= 0).any())):
        raise DeltaError(f"indices of {p!r} are not increasing flat indices into {size} elements")
    return idx


def _index_key(key: str, tensors: dict) -> str:
    return f"{key}::runs" if f"{key}::runs" in tensors else f"{key}::index"


def stored_keys(p: str, info: dict, tensors: dict) -> list[str]:
    """The tensor keys a variable entry needs."""
    kind = info["kind"]
    checks = [_index_key(c["trained"], tensors) for c in info.get("checks", ()) if c.get("trained")]
    if kind in ("trainable", "untrained"):
        return [p, *checks]
    if kind == "partial":
        return [_index_key(p, tensors), f"{p}::values", *checks]
    return checks


def _safetensors_bytes(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> list[bytes]:
    """A safetensors file as chunks: the header (metadata keys sorted), then each tensor's bytes.

    Tensors go by alignment (widest dtype first), then by name, so every
    tensor starts at a multiple of its item size; the header is padded with
    spaces to a multiple of 8 bytes, as the format allows.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(meta.items()))}
    chunks, offset = [], 0
    for k in order:
        a = tensors[k]
        code = _SAFETENSORS_DTYPES.get(str(a.dtype))
        if code is None:
            raise DeltaError(f"tensor {k!r} has dtype {a.dtype}, which a safetensors file cannot hold")
        data = a.tobytes()
        header[k] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little"), text, *chunks]


def write(
    tensors: dict[str, np.ndarray],
    variables: dict,
    plan: str,
    version: str,
    path: str,
    *,
    base: dict | None = None,
) -> None:
    """Write a delta to ``path`` (the caller makes it atomic); the same arguments give the same bytes."""
    tensors = {k: np.asarray(v, order="C") for k, v in tensors.items()}  # (ascontiguousarray makes a scalar 1-D)
    table = {
        k: {"dtype": str(v.dtype), "shape": list(v.shape), "sha256": _sha256(v)} for k, v in sorted(tensors.items())
    }
    meta = {
        "format": FORMAT,
        "finefreeze": version,
        "plan": plan,
        "variables": json.dumps(variables),
        "tensors": json.dumps(table),
    }
    if base is not None:
        meta["base"] = json.dumps(base, sort_keys=True)
    meta["checksum"] = _meta_checksum(meta)
    chunks = _safetensors_bytes(tensors, meta)  # built first: a failing write below is an OSError
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c)


def _open(path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    from safetensors import safe_open

    if not os.path.exists(path):
        raise DeltaError(f"delta file {path!r} does not exist.")
    if os.path.isdir(path):
        raise DeltaError(f"delta {path!r} is a folder; give a .safetensors file.")
    with open(path, "rb") as f:
        if f.read(4) == b"PK\x03\x04":  # a zip archive: a .keras model, not a delta
            raise DeltaError(
                f"delta file {path!r} is a zip archive (a .keras model?), not a delta; give the "
                ".safetensors file that save_delta or `finefreeze delta export` wrote."
            )
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        first = (str(e).splitlines() or [""])[0]
        raise DeltaError(
            f"delta file {path!r} is damaged or truncated ({type(e).__name__}: {first}); export it again."
        ) from None
    return meta, tensors


def read_json(path: str, key: str) -> Any:
    """The JSON metadata entry ``key`` of the delta at ``path`` (``plan``, ``base``), or None; not checked."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as f:
            return json.loads((f.metadata() or {}).get(key, "null"))
    except Exception:
        return None


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The ``variables`` metadata and the tensors of a delta, every byte checked.

    Raises:
        DeltaError: a file of another format than :data:`FORMAT`, or naming
            the tensor or metadata entry that is damaged, missing or extra.
    """
    meta, tensors = _open(path)
    fmt = meta.get("format")
    if fmt != FORMAT:
        found = "has no format entry" if fmt is None else f"is format {fmt!r}"
        raise DeltaError(
            f"delta {path!r} {found}; finefreeze {__version__} reads delta files of format {FORMAT!r} only. "
            f"Export it again with finefreeze {__version__} from the tuned model: "
            "`finefreeze delta export TUNED.keras -o DELTA.safetensors` (or Freezer.save_delta)."
        )
    if meta.get("checksum") != _meta_checksum(meta):
        raise DeltaError(f"delta {path!r}: its metadata is damaged (checksum mismatch); export it again.")
    where = "metadata"
    try:
        variables = json.loads(meta["variables"])
        table = json.loads(meta["tensors"])
        extra = sorted(set(tensors) - set(table))
        if extra:
            raise DeltaError(f"tensor {extra[0]!r} is not listed in the metadata")
        for key, t in table.items():
            where = f"tensor {key!r}"
            if key not in tensors:
                raise DeltaError(f"{where} is listed in the metadata but missing from the file")
            got = tensors[key]
            if str(got.dtype) != t["dtype"] or list(got.shape) != list(t["shape"]):
                raise DeltaError(
                    f"{where} is {got.dtype} {got.shape} but the metadata says {t['dtype']} {tuple(t['shape'])}"
                )
            if _sha256(got) != t["sha256"]:
                raise DeltaError(f"{where}: its bytes are damaged (sha256 mismatch)")
        needed = set()
        for p, info in variables.items():
            where = f"variable {p!r}"
            if info["kind"] not in STATES:
                raise DeltaError(f"{where} has unknown kind {info['kind']!r}")
            np.dtype(info["dtype"])
            [int(n) for n in info["shape"]]
            if info["kind"] in ("partial", "frozen") and "checks" not in info:
                str(info["frozen"])  # its one check of the base; without it the entry is malformed
            keys = stored_keys(p, info, tensors)
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise DeltaError(f"tensor {missing[0]!r} of {where} is missing")
            needed.update(keys)
        unused = sorted(set(tensors) - needed)
        if unused:
            raise DeltaError(f"tensor {unused[0]!r} belongs to no variable of the metadata")
    except DeltaError as e:
        raise DeltaError(f"delta {path!r}: {e}") from None
    except Exception as e:  # malformed metadata: wrong types, missing fields
        raise DeltaError(f"delta {path!r}: {where} is malformed ({type(e).__name__}: {e}); export it again.") from None
    return variables, tensors
