"""Delta files: only what training may have changed, as safetensors (format in ``deltafile``).

A delta holds the values of trainable variables in full, and for partially
frozen variables the flat indices and values of their trainable elements.
Its metadata names the library version, the plan, a fingerprint of the
frozen part of every variable (``load_delta`` refuses a base whose frozen
part differs) and a checksum of every stored tensor. ``load_delta`` checks
everything before it writes anything, and restores what it wrote if a write
fails. Values are written in place, element by element
(:mod:`finefreeze._files.switch`). Files are written atomically (temporary
file, fsync, rename).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from finefreeze._errors import DeltaError, PlanError
from finefreeze._files import deltafile
from finefreeze._files.entries import bind, digest, read_entries
from finefreeze._files.switch import WriteFailed, apply_bound
from finefreeze._keras.quantized import quantized_values
from finefreeze._slices.choose import standin_of
from finefreeze._slices.held import delta_elements, retrace
from finefreeze._version import __version__

__all__ = ["save_delta", "load_delta", "write_file"]


def save_delta(frz, path: str | os.PathLike, *, base: dict | None = None) -> dict[str, Any]:
    """Write the delta of ``frz``'s target to ``path``; return a summary.

    ``base``: what the model was built from (the command line records a
    KerasHub preset and the task built on it), stored in the metadata.
    """
    tensors: dict[str, np.ndarray] = {}
    meta_vars = {}
    res = frz._res
    # a quantized kernel's scales and zero points are its integers' companions: checked, never written
    constants = {id(v) for st in res.states if st.info.quantized for v in quantized_values(st.info.owner, st.variable)}
    for st in res.states:
        p, var, kind, mask = st.path, st.variable, res.kind_of(st), st.mask
        kind = "frozen" if kind == "untrained" and id(var) in constants else kind
        if st.info.quantized is not None:  # its float delta, and a digest of its integers whole
            meta_vars[p] = _quantized(p, st, kind, tensors)
            continue
        value = np.asarray(var.numpy(), order="C")  # a scalar stays one (ascontiguousarray makes it 1-D)
        info = {"shape": list(value.shape), "dtype": str(value.dtype), "kind": kind}
        if kind in ("trainable", "untrained"):
            tensors[p] = value
        elif kind == "partial":
            idx = mask.trainable_flat_indices()
            tensors.update(deltafile.encode_index(p, idx))
            tensors[f"{p}::values"] = value.reshape(-1)[idx]
            info["frozen"] = digest(value, idx)
        else:
            info["frozen"] = digest(value, None)
        meta_vars[p] = info
    try:
        plan = json.dumps(frz.plan.to_dict())
    except PlanError:
        plan = "null"
    return write_file(path, tensors, meta_vars, plan, base=base)


def _quantized(p: str, st, kind: str, tensors: dict) -> dict:
    """The metadata of a quantized kernel (its logical shape, its float delta's dtype), its delta put in ``tensors``."""
    info = {"shape": list(st.info.shape), "dtype": st.info.dtype, "kind": kind, "quantized": st.info.quantized}
    info["frozen"] = digest(np.ascontiguousarray(np.asarray(st.variable.numpy())), None)
    if kind == "partial":
        idx = st.mask.trainable_flat_indices()
        delta = _delta_values(st)
        places = np.searchsorted(delta_elements(st.info.owner, st.variable), idx)
        tensors.update(deltafile.encode_index(p, idx))
        tensors[f"{p}::values"] = np.ascontiguousarray(delta[places])
    return info


def _delta_values(st) -> np.ndarray:
    """The float delta a quantized kernel's layer holds (every element it holds, in flat order)."""
    mark = standin_of(st.info.owner, st.variable)
    return np.asarray(mark.numpy())


def write_file(path, tensors, variables, plan: str, *, base=None) -> dict[str, Any]:
    """Write a delta atomically (temporary file, fsync, rename); return ``{path, bytes, tensors}``."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        deltafile.write(tensors, variables, plan, __version__, tmp, base=base)
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
            on (a quantized kernel's: a float delta of values where the file
            has none), or a failed write (the base is restored). The message
            names the tensor or variable.

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
    entries = read_entries(path)
    bound = bind(target, entries, f"delta {path!r}")
    try:
        apply_bound(bound)
    except WriteFailed as e:  # every element written so far was written back
        raise DeltaError(f"delta {path!r}: {e}; the base was restored.") from None
    finally:
        if any(b.entry.quantized for b in bound):  # a quantized kernel's delta came: the model computes anew
            retrace(target)
    return {"variables": len(bound), "elements": sum(b.entry.elements for b in bound)}
