"""One delta from several trained on disjoint elements of one base (``merge_deltas``).

Applying the merged delta equals applying each of them: its written
elements are the union of theirs, and it keeps every check each of them
makes on the base (its ``checks``, :mod:`finefreeze._files.deltafile`), so it
refuses any base one of them would refuse.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from finefreeze._errors import DeltaError
from finefreeze._files import deltafile
from finefreeze._files.delta import write_file
from finefreeze._files.entries import Entry, encode, read_entries

__all__ = ["merge_deltas", "merge_entries"]

_FULL = ("trainable", "untrained")


def _where(flat: int, shape: tuple[int, ...]) -> str:
    return str(tuple(int(i) for i in np.unravel_index(flat, shape))) if shape else "()"


def _overlap(p: str, parts: list[tuple[str, Entry]]) -> None:
    """Raise :class:`DeltaError` naming the first elements of ``p`` that two deltas both write."""
    written = [(name, e.trained()) for name, e in parts if e.values is not None]
    if len(written) < 2:
        return
    for i, (a, ia) in enumerate(written):
        for b, ib in written[i + 1 :]:
            both = np.intersect1d(ia, ib, assume_unique=True)
            if both.size:
                shape = parts[0][1].shape
                first = ", ".join(_where(int(k), shape) for k in both[:3])
                more = f" and {both.size - 3:,} more" if both.size > 3 else ""
                raise DeltaError(
                    f"merge_deltas: {a!r} and {b!r} both write {p!r} (shape {shape}) at {first}{more}: deltas "
                    "merge only when they train disjoint elements (serve such deltas one at a time with DeltaSwitch)."
                )


def _merge_one(p: str, parts: list[tuple[str, Entry]]) -> Entry:
    first_name, first = parts[0]
    for name, e in parts[1:]:
        if (e.shape, e.dtype, e.quantized) != (first.shape, first.dtype, first.quantized):
            raise DeltaError(
                f"merge_deltas: {p!r} is {first.shape} {first.dtype} in {first_name!r} but {e.shape} {e.dtype} in "
                f"{name!r}: these deltas were trained from different bases."
            )
    _overlap(p, parts)
    checks: dict[tuple[bytes, str], tuple[np.ndarray, str]] = {}
    whole: dict[str, str] = {}  # the digest of the whole variable, per delta that freezes all of it
    for name, e in parts:
        for trained, d in e.checks:
            checks.setdefault((trained.tobytes(), d), (trained, d))
            if not trained.size:
                whole[name] = d
    if len(set(whole.values())) > 1:
        a, b = list(whole)[:2]
        raise DeltaError(
            f"merge_deltas: {p!r} (shape {first.shape}) is frozen in {a!r} and {b!r} but with different values: "
            "these deltas were trained from different bases."
        )
    checks = dict(sorted(checks.items(), key=lambda kv: kv[0]))  # the same file whatever the order of the deltas
    writers = [e for _, e in parts if e.values is not None]
    full = [e for e in writers if e.kind in _FULL]
    if full:
        e = full[0]
        return Entry(p, e.kind, e.shape, e.dtype, None, e.values, list(checks.values()), first.quantized)
    if writers:
        index = np.concatenate([e.index for e in writers])
        values = np.concatenate([e.values for e in writers])
        order = np.argsort(index, kind="stable")
        checked = list(checks.values())
        return Entry(p, "partial", first.shape, first.dtype, index[order], values[order], checked, first.quantized)
    return Entry(p, "frozen", first.shape, first.dtype, None, None, list(checks.values()), first.quantized)


def merge_entries(named: list[tuple[str, dict[str, Entry]]]) -> dict[str, Entry]:
    """The entries of one delta equal to applying each of ``named`` (``(name, entries)`` pairs).

    Raises:
        DeltaError: the deltas list different variables, or shapes, or
            frozen values (different bases), or two write the same element.
    """
    first_name, first = named[0]
    for name, entries in named[1:]:
        extra = sorted(set(entries) ^ set(first))
        if extra:
            has, lacks = (name, first_name) if extra[0] in entries else (first_name, name)
            raise DeltaError(
                f"merge_deltas: {has!r} holds variable {extra[0]!r} and {lacks!r} does not: deltas merge only "
                "when they were trained from one base model (the same variables)."
            )
    return {p: _merge_one(p, [(name, entries[p]) for name, entries in named]) for p in first}


def merge_deltas(paths: list[str | os.PathLike], out_path: str | os.PathLike) -> dict[str, Any]:
    """Write one delta that equals applying each of ``paths``, deltas trained on disjoint elements of one base.

    Each file is read and checked in full first; nothing is written unless
    every check passes. The merged file keeps every delta's check of the
    base (each variable's ``checks``), so ``load_delta`` and
    ``DeltaSwitch`` refuse any base one of them would refuse.

    Args:
        paths: two or more ``.safetensors`` deltas of the same base model.
        out_path: the delta to write (atomically: temporary file, rename).

    Returns:
        ``{"path", "bytes", "tensors", "elements"}``: the file written and
        how many elements it writes.

    Raises:
        DeltaError: a damaged file; deltas of different bases (other
            variables, shapes or frozen values); two deltas that write the
            same element (the message names the variable and the first
            elements); fewer than two paths; ``out_path`` one of ``paths``.

    Example:
        >>> import keras, numpy as np, finefreeze as ff, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> for k in (0, 1):  # two tasks: each trains one row of the same base
        ...     w = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        ...     frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train(f"w[{k}]")]))
        ...     new = np.zeros((2, 2), "float32"); new[k] = k + 1.0
        ...     _ = w.assign(new)
        ...     _ = frz.save_delta(os.path.join(d, f"{k}.safetensors"))
        >>> _ = ff.merge_deltas([os.path.join(d, "0.safetensors"), os.path.join(d, "1.safetensors")],
        ...                     os.path.join(d, "both.safetensors"))
        >>> base = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        >>> _ = ff.load_delta([base], os.path.join(d, "both.safetensors"))
        >>> base.numpy().tolist()
        [[1.0, 1.0], [2.0, 2.0]]
    """
    if isinstance(paths, (str, os.PathLike)):
        raise DeltaError(
            f"merge_deltas: paths is a list of two or more delta files, got one path {os.fspath(paths)!r}."
        )
    paths = [os.fspath(p) for p in paths]
    out_path = os.fspath(out_path)
    if len(paths) < 2:
        raise DeltaError(f"merge_deltas: give two or more delta files to merge, got {len(paths)}.")
    if os.path.isdir(out_path):
        raise DeltaError(f"merge_deltas: out_path {out_path!r} is a folder; give a file name.")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise DeltaError(f"merge_deltas: the folder of out_path {out_path!r} does not exist.")
    same = [p for p in paths if os.path.abspath(p) == os.path.abspath(out_path)]
    if same:
        raise DeltaError(f"merge_deltas: out_path {out_path!r} is one of the deltas to merge; write to a new file.")
    entries = merge_entries([(p, read_entries(p)) for p in paths])
    tensors, variables = encode(entries)
    plans = sorted((deltafile.read_json(p, "plan") for p in paths), key=lambda p: json.dumps(p, sort_keys=True))
    info = write_file(out_path, tensors, variables, json.dumps({"merged": plans}))
    info["elements"] = sum(e.elements for e in entries.values())
    return info
