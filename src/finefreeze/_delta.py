"""Delta files: only what training may have changed, as safetensors.

A delta holds the values of trainable variables in full, and for partially
frozen variables the flat indices and values of their trainable elements.
Its metadata names the library version, the plan, and a fingerprint of the
frozen part of every variable, so ``load_delta`` refuses a base whose frozen
part differs. Files are written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from finefreeze._errors import DeltaError, PlanError

__all__ = ["save_delta", "load_delta"]

_FORMAT = "finefreeze.delta/1"


def _digest(value: np.ndarray, frozen: np.ndarray | None) -> str:
    from finefreeze._fingerprint import block_hashes

    return hashlib.blake2b(block_hashes(value, frozen).tobytes(), digest_size=16).hexdigest()


def _encode_index(p: str, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Flat indices as runs ``(start, length)`` or a plain list, whichever is smaller."""
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = idx[np.r_[0, breaks]]
    lengths = np.diff(np.r_[0, breaks, idx.size])
    dtype = np.int32 if idx.size == 0 or idx[-1] < 2**31 else np.int64
    if 2 * starts.size < idx.size:
        return {f"{p}::runs": np.stack([starts, lengths], axis=1).astype(dtype)}
    return {f"{p}::index": idx.astype(dtype)}


def _decode_index(p: str, tensors) -> np.ndarray:
    if f"{p}::runs" in tensors:
        runs = tensors[f"{p}::runs"].astype(np.int64)
        if runs.size == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(s, s + n) for s, n in runs])
    return tensors[f"{p}::index"].astype(np.int64)


def save_delta(frz, path: str | os.PathLike) -> dict[str, Any]:
    """Write the delta of ``frz``'s target to ``path``; return a summary."""
    from safetensors.numpy import save_file

    tensors: dict[str, np.ndarray] = {}
    meta_vars = {}
    res = frz.resolution
    for st in res.states:
        p, var, kind, mask = st.path, st.variable, res.kind_of(st), st.mask
        value = np.ascontiguousarray(np.asarray(var.numpy()))
        info = {"shape": list(value.shape), "dtype": str(value.dtype), "kind": kind}
        if kind in ("trainable", "untrained"):
            tensors[p] = value
        elif kind == "partial":
            idx = mask.trainable_flat_indices()
            tensors.update(_encode_index(p, idx))
            tensors[f"{p}::values"] = value.reshape(-1)[idx]
            info["frozen"] = _digest(value, mask.dense())
        else:
            info["frozen"] = _digest(value, None)
        meta_vars[p] = info
    try:
        plan = json.dumps(frz.plan.to_dict())
    except PlanError:
        plan = "null"
    from finefreeze._version import __version__

    metadata = {"format": _FORMAT, "finefreeze": __version__, "plan": plan, "variables": json.dumps(meta_vars)}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # a plain file, like any other write
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"path": path, "bytes": os.path.getsize(path), "tensors": len(tensors)}


def _read(path: str):
    from safetensors import safe_open

    if not os.path.exists(path):
        raise DeltaError(f"delta file {path!r} does not exist.")
    try:
        with safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise DeltaError(
            f"delta file {path!r} is damaged or truncated ({type(e).__name__}: {e}); write it again with save_delta."
        ) from None
    if meta.get("format") != _FORMAT:
        raise DeltaError(f"{path!r} is not a finefreeze delta file (format {meta.get('format')!r}).")
    return meta, tensors


def load_delta(target: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Apply a delta file written by ``Freezer.save_delta`` to a base model.

    Every check runs before any value is written: on error the target is
    unchanged.

    Args:
        target: the base (a Keras model or layer, a ``tf.Module`` or a list
            of variables) with the same variable paths as the tuned model.
        path: the ``.safetensors`` delta file.

    Returns:
        A summary dict: ``{"variables": n, "elements": n}`` written.

    Raises:
        DeltaError: missing or damaged file, a variable missing from the
            base or of another shape or dtype, or a base whose frozen part
            differs from the one the delta was trained on.

    Example:
        >>> import keras, numpy as np, finefreeze as ff, tempfile, os
        >>> w = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
        >>> _ = w.assign([[0.0, 0.0], [1.0, 2.0]])
        >>> f = os.path.join(tempfile.mkdtemp(), "d.safetensors")
        >>> _ = frz.save_delta(f)
        >>> base = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        >>> ff.load_delta([base], f)["elements"]
        2
        >>> base.numpy().tolist()
        [[0.0, 0.0], [1.0, 2.0]]
    """
    from finefreeze._targets import collect, match_path

    path = os.fspath(path)
    meta, tensors = _read(path)
    variables = json.loads(meta["variables"])
    try:
        t = collect(target)
    except PlanError as e:
        raise DeltaError(str(e)) from None
    by_path = {n: vi for vi in t.variables for n in vi.names}
    writes = []
    for p, info in variables.items():
        try:
            vi = match_path(p, by_path)
        except PlanError as e:
            raise DeltaError(f"delta {path!r}: {e}") from None
        if vi is None:
            raise DeltaError(f"delta {path!r}: the base has no variable {p!r} (shape {tuple(info['shape'])}).")
        if list(vi.shape) != info["shape"] or np.dtype(vi.dtype) != np.dtype(info["dtype"]):
            raise DeltaError(
                f"delta {path!r}: variable {p!r} is {vi.shape} {vi.dtype} in the base but "
                f"{tuple(info['shape'])} {info['dtype']} in the delta."
            )
        kind = info["kind"]
        if kind in ("trainable", "untrained"):
            writes.append((vi.variable, tensors[p]))
            continue
        base = np.asarray(vi.variable.numpy())
        if kind == "partial":
            idx = _decode_index(p, tensors)
            if idx.size and (idx.min() < 0 or idx.max() >= base.size):
                raise DeltaError(f"delta {path!r}: indices of {p!r} do not fit shape {tuple(base.shape)}.")
            frozen = np.ones(base.size, bool)
            frozen[idx] = False
            got = _digest(base, frozen.reshape(base.shape))
        else:
            got = _digest(base, None)
        if got != info["frozen"]:
            raise DeltaError(
                f"delta {path!r}: the frozen part of {p!r} (shape {tuple(base.shape)}) differs from "
                "the base the delta was trained on (fingerprint mismatch); apply it to that base."
            )
        if kind == "partial":
            flat = base.reshape(-1).copy()
            flat[idx] = tensors[f"{p}::values"]
            writes.append((vi.variable, flat.reshape(base.shape)))
    from finefreeze._distribute import owner_scope

    with owner_scope([v for v, _ in writes]):
        for var, value in writes:
            var.assign(value)
    n_partial = sum(int(tensors[f"{p}::values"].size) for p, i in variables.items() if i["kind"] == "partial")
    n_full = sum(
        int(np.prod(i["shape"], dtype=np.int64)) for i in variables.values() if i["kind"] in ("trainable", "untrained")
    )
    return {"variables": len(writes), "elements": n_partial + n_full}
