"""Delta files: only what training may have changed, as safetensors (format in ``deltafile``).

A delta holds the values of trainable variables in full, and for partially
frozen variables the flat indices and values of their trainable elements.
Its metadata names the library version, the plan, a fingerprint of the
frozen part of every variable (``load_delta`` refuses a base whose frozen
part differs) and a checksum of every stored tensor. ``load_delta`` checks
everything before it writes anything, and restores what it wrote if a write
fails. Files are written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np

from finefreeze._backends.distribute import owner_scope
from finefreeze._errors import DeltaError, PlanError
from finefreeze._files import deltafile
from finefreeze._resolve.fingerprint import block_hashes
from finefreeze._resolve.targets import collect, match_path
from finefreeze._version import __version__

__all__ = ["save_delta", "load_delta"]


def _digest(value: np.ndarray, frozen: np.ndarray | None) -> str:
    return hashlib.blake2b(block_hashes(value, frozen).tobytes(), digest_size=16).hexdigest()


def save_delta(frz, path: str | os.PathLike) -> dict[str, Any]:
    """Write the delta of ``frz``'s target to ``path``; return a summary."""
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
            tensors.update(deltafile.encode_index(p, idx))
            tensors[f"{p}::values"] = value.reshape(-1)[idx]
            info["frozen"] = _digest(value, mask.dense())
        else:
            info["frozen"] = _digest(value, None)
        meta_vars[p] = info
    try:
        plan = json.dumps(frz.plan.to_dict())
    except PlanError:
        plan = "null"
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        deltafile.write(tensors, meta_vars, plan, __version__, tmp)
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


def _plan_writes(path: str, variables: dict, tensors: dict, by_path: dict) -> list[tuple[str, Any, np.ndarray]]:
    """Every ``(path, variable, new value)`` to write, after every check against the base."""
    writes = []
    for p, info in variables.items():
        try:
            vi = match_path(p, by_path)
        except PlanError as e:
            raise DeltaError(f"delta {path!r}: {e}") from None
        shape, dtype = tuple(int(n) for n in info["shape"]), np.dtype(info["dtype"])
        if vi is None:
            raise DeltaError(f"delta {path!r}: the base has no variable {p!r} (shape {shape}).")
        if tuple(vi.shape) != shape or np.dtype(vi.dtype) != dtype:
            raise DeltaError(
                f"delta {path!r}: variable {p!r} is {tuple(vi.shape)} {vi.dtype} in the base but "
                f"{shape} {dtype} in the delta."
            )
        kind = info["kind"]
        if kind in ("trainable", "untrained"):
            value = tensors[p]
            if value.dtype != dtype or value.shape != shape:
                raise DeltaError(
                    f"delta {path!r}: tensor {p!r} is {value.dtype} {value.shape}, its variable {dtype} {shape}."
                )
            writes.append((p, vi.variable, value))
            continue
        base = np.asarray(vi.variable.numpy())
        frozen = None
        if kind == "partial":
            try:
                idx = deltafile.decode_index(p, tensors, base.size)
            except DeltaError as e:
                raise DeltaError(f"delta {path!r}: {e}") from None
            values = tensors[f"{p}::values"]
            if values.dtype != dtype or values.shape != idx.shape:
                raise DeltaError(
                    f"delta {path!r}: tensor {p + '::values'!r} is {values.dtype} {values.shape} but "
                    f"{p!r} needs {dtype} ({idx.size},) for its {idx.size} trainable elements."
                )
            frozen = np.ones(base.size, bool)
            frozen[idx] = False
            frozen = frozen.reshape(base.shape)
        if _digest(base, frozen) != info.get("frozen"):
            raise DeltaError(
                f"delta {path!r}: the frozen part of {p!r} (shape {tuple(base.shape)}) differs from "
                "the base the delta was trained on (fingerprint mismatch); apply it to that base."
            )
        if kind == "partial":
            flat = base.reshape(-1).copy()
            flat[idx] = values
            writes.append((p, vi.variable, flat.reshape(base.shape)))
    return writes


def load_delta(target: Any, path: str | os.PathLike) -> dict[str, Any]:
    """Apply a delta file written by ``Freezer.save_delta`` to a base model.

    All or nothing: the file's checksums, keys, shapes and dtypes and the
    base's frozen part are checked before any value is written, and if a
    write fails the values already written are restored.

    Args:
        target: the base (a Keras model or layer, a ``tf.Module`` or a list
            of variables) with the same variable paths as the tuned model.
        path: the ``.safetensors`` delta file.

    Returns:
        A summary dict: ``{"variables": n, "elements": n}`` written.

    Raises:
        DeltaError: missing or damaged file (header, metadata or tensor
            bytes), a tensor missing, extra or of another dtype or shape, a
            variable missing from the base or of another shape or dtype, a
            base whose frozen part differs from the one the delta was trained
            on, or a failed write (the base is restored). The message names
            the tensor or variable.

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
    path = os.fspath(path)
    variables, tensors = deltafile.read(path)
    try:
        t = collect(target)
    except PlanError as e:
        raise DeltaError(str(e)) from None
    by_path = {n: vi for vi in t.variables for n in vi.names}
    writes = _plan_writes(path, variables, tensors, by_path)
    done: list[tuple[Any, np.ndarray]] = []
    with owner_scope([v for _, v, _ in writes]):
        for p, var, value in writes:
            old = np.array(var.numpy(), copy=True)
            try:
                var.assign(value)
            except BaseException as e:  # an interrupt too: never leave the base half-written
                for v, o in reversed(done):
                    v.assign(o)
                if not isinstance(e, Exception):
                    raise
                raise DeltaError(
                    f"delta {path!r}: writing {p!r} failed ({type(e).__name__}: {e}); the base was restored."
                ) from None
            done.append((var, old))
    n_partial = sum(int(tensors[f"{p}::values"].size) for p, i in variables.items() if i["kind"] == "partial")
    n_full = sum(int(tensors[p].size) for p, i in variables.items() if i["kind"] in ("trainable", "untrained"))
    return {"variables": len(writes), "elements": n_partial + n_full}
