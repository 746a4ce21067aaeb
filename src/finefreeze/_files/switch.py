"""Sparse deltas put into a model and taken out again in place, bit for bit (``DeltaSwitch``).

A delta written in keeps the values it overwrote (those elements only) and
writes them back when it is taken out. Every write is in place
(:mod:`finefreeze._backends.elements`): a switch costs reads and writes of
the deltas' elements, not of the model. A switch is one transaction: if a
write fails (or Ctrl-C arrives), what was written is written back and the
model holds what it held before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from finefreeze._backends.chosen import indexes_in_int64_only
from finefreeze._backends.distribute import owner_scope
from finefreeze._backends.elements import read_elements, write_elements
from finefreeze._errors import DeltaError
from finefreeze._files.entries import Bound, QuantizedBound, bind, digest, read_entries
from finefreeze._resolve.targets import collect
from finefreeze._slices.held import hold_delta, retrace

__all__ = ["DeltaSwitch", "WriteFailed", "apply_bound"]


def _narrow(bound: list[Bound]) -> list[Bound]:
    """The same entries with int32 indices where they fit (half the memory, and JAX's default integer).

    PyTorch indexes with int64 only: its entries keep them (no conversion per switch). Their
    checks were made (:func:`bind`) and are dropped: a switch holds indices and values only.
    """
    wide = indexes_in_int64_only()
    for b in bound:
        b.entry.checks = []
        if wide:
            continue
        idx = b.entry.index
        if idx is not None and idx.dtype != np.int32 and (idx.size == 0 or idx[-1] < 2**31):
            b.entry.index = idx.astype(np.int32)
    return bound


def _write(b: Bound, values: np.ndarray) -> None:
    try:
        write_elements(b.variable, b.entry.index, values)
    except Exception as e:
        raise WriteFailed(b.entry.path, e) from None


def _write_back(bound: list[Bound], saved: list[np.ndarray]) -> None:
    for b, old in reversed(list(zip(bound, saved))):
        _write(b, old)


class WriteFailed(Exception):
    """A write of a delta's elements failed; every element written before it was written back."""

    def __init__(self, path: str, cause: Exception):
        super().__init__(f"writing {path!r} failed ({type(cause).__name__}: {cause})")


def apply_bound(bound: list[Bound], kept: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Write every bound entry; return the values each overwrote. All or nothing.

    ``kept``: the values the entries overwrite, known already (the base's,
    kept from an earlier switch): then they are not read again.

    Raises:
        WriteFailed: a write failed, naming the variable.
        BaseException: an interrupt; in either case every element written
            so far was written back first.
    """
    saved: list[np.ndarray] = []
    with owner_scope([b.variable for b in bound]):
        try:
            for k, b in enumerate(bound):
                old = read_elements(b.variable, b.entry.index) if kept is None else kept[k]
                _write(b, b.entry.values)
                saved.append(old)
        except BaseException:
            _write_back(bound[: len(saved)], saved)
            raise
    return saved


def _hold_deltas(deltas) -> bool:
    """Give each quantized kernel the deltas write a float delta holding all their elements, now.

    Made here, not at the first switch: a delta widened later would be a new
    variable, and a step compiled before (a ``predict``) would not see it.
    """
    union: dict[int, tuple] = {}
    for bound in deltas:
        for b in bound:
            if isinstance(b, QuantizedBound):
                layer, kernel, have = union.get(id(b.kernel), (b.layer, b.kernel, np.zeros(0, np.int64)))
                union[id(b.kernel)] = (layer, kernel, np.union1d(have, b.logical))
    for layer, kernel, index in union.values():
        hold_delta(layer, kernel, index)
    return bool(union)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes (NaNs and signed zeros included), without copying them."""
    if a.shape != b.shape:
        return False
    flat_a, flat_b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    return np.array_equal(flat_a.view(np.uint8), flat_b.view(np.uint8))


class DeltaSwitch:
    """Named sparse deltas of one base model, switched in place, bit for bit.

    Each delta is read and checked against ``model`` once, when the switch
    is made: its file (checksums), its variables (paths, shapes, dtypes)
    and the base's frozen part (fingerprints). The deltas stay in memory in
    their sparse form (indices and values). ``use(name)`` takes the active
    delta out (writing back the values it overwrote) and puts ``name`` in,
    as one transaction; ``use(None)`` leaves the base, bit for bit.

    Args:
        model: the base model (or layer, ``tf.Module`` or list of variables)
            every delta was trained from, as it was loaded: no delta in it.
        deltas: name → path of a ``.safetensors`` delta (``save_delta``,
            ``finefreeze delta export``, ``merge_deltas``).

    ``use`` checks that the active delta's elements still hold its values
    (cheap); :meth:`verify` checks every variable against the base. The
    base's values at a delta's elements, read when it first goes in, are
    kept for its next use (one value per element of each delta used). On JAX
    a switch donates the written variables' buffers to XLA (that is how
    it writes in place, as Keras' own train step does): arrays read from
    them before (``variable.value``, state handed to ``stateless_call``)
    are invalid after it; read them again.

    Raises:
        DeltaError: a damaged file, a delta that does not fit ``model`` (a
            variable missing or of another shape or dtype, a frozen part
            that differs), an empty ``deltas``, a name that is not a
            non-empty string or a path that is not one. Nothing is written.

    Example:
        >>> import keras, numpy as np, finefreeze as ff, tempfile, os
        >>> w = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
        >>> _ = w.assign([[0.0, 0.0], [1.0, 2.0]])
        >>> f = os.path.join(tempfile.mkdtemp(), "d.safetensors")
        >>> _ = frz.save_delta(f)
        >>> base = keras.Variable(np.zeros((2, 2), "float32"), name="w")
        >>> switch = ff.DeltaSwitch([base], {"task": f})
        >>> _ = switch.use("task")
        >>> base.numpy().tolist(), switch.active
        ([[0.0, 0.0], [1.0, 2.0]], 'task')
        >>> _ = switch.use(None)
        >>> base.numpy().tolist(), switch.active
        ([[0.0, 0.0], [0.0, 0.0]], None)
    """

    def __init__(self, model: Any, deltas: Mapping[str, str | os.PathLike]) -> None:
        if isinstance(model, (str, os.PathLike)):
            raise DeltaError(
                f"DeltaSwitch(model, deltas): model is the loaded base model, not a path ({os.fspath(model)!r}); "
                "load it first (keras.models.load_model)."
            )
        if not isinstance(deltas, Mapping) or not deltas:
            raise DeltaError(
                f"DeltaSwitch(model, deltas): deltas is a dict of name -> delta file, got {type(deltas).__name__} "
                f"{deltas!r:.80}; e.g. DeltaSwitch(model, {{'task_a': 'a.safetensors'}})."
            )
        bad = [n for n in deltas if not isinstance(n, str) or not n]
        if bad:
            raise DeltaError(
                f"DeltaSwitch: delta names are non-empty strings (None stands for the base); got {bad[0]!r}."
            )
        self._deltas: dict[str, list[Bound]] = {}
        self._paths: dict[str, str] = {}
        for name, path in deltas.items():
            if not isinstance(path, (str, os.PathLike)):
                raise DeltaError(f"DeltaSwitch: delta {name!r} is {path!r}; give the path of its .safetensors file.")
            path = os.fspath(path)
            try:
                entries = read_entries(path)
            except DeltaError as e:
                raise DeltaError(f"delta {name!r}: {e}") from None
            self._deltas[name] = _narrow(bind(model, entries, f"delta {name!r} ({path!r})"))
            self._paths[name] = path
        if _hold_deltas(self._deltas.values()):  # a quantized kernel's delta, for every delta's elements: made once
            retrace(model)
        self._every_variable = [(vi.path, vi.variable) for vi in collect(model).variables]
        self._base = {p: digest(read_elements(v, None), None) for p, v in self._every_variable}
        self._active: str | None = None
        self._saved: list[np.ndarray] = []
        self._kept: dict[str, list[np.ndarray]] = {}  # per delta used once: the base's values at its elements

    @property
    def active(self) -> str | None:
        """The name of the delta in the model now, or None for the base."""
        return self._active

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the deltas this switch holds, in the order given."""
        return tuple(self._deltas)

    def elements(self, name: str) -> int:
        """How many elements delta ``name`` writes."""
        return sum(b.entry.elements for b in self._deltas[self._known(name, "elements")])

    def _known(self, name: str | None, method: str = "use") -> str | None:
        if name is not None and (not isinstance(name, str) or name not in self._deltas):
            known = ", ".join(repr(n) for n in self._deltas)
            raise DeltaError(
                f"DeltaSwitch.{method}: no delta named {name!r}; this switch holds {known} (and None, the base)."
            )
        return name

    def _check_untouched(self) -> None:
        """Raise unless the active delta's elements still hold its values (nothing wrote over them since)."""
        for b in self._deltas[self._active] if self._active is not None else ():
            if not _same_bytes(read_elements(b.variable, b.entry.index), b.entry.values):
                raise DeltaError(
                    f"DeltaSwitch.use: {b.entry.path!r} no longer holds the values of delta {self._active!r}: something "
                    "wrote to the model since it was switched in (training, an assign, a weight load), so taking "
                    "it out would not give the base back. Nothing was changed; make a new switch from the base."
                )

    def use(self, name: str | None) -> dict[str, Any]:
        """Put delta ``name`` into the model in place of the active one (None: the base alone).

        One transaction: the active delta's elements get back the values
        they had before it, then ``name``'s are written; if anything fails
        (Ctrl-C included) the model is left as it was.

        Args:
            name: a name given to the switch, or None for the base.

        Returns:
            ``{"active": name, "elements": n}``: the elements ``name`` wrote.

        Raises:
            DeltaError: an unknown name, or the active delta's elements were
                changed by something else since it was switched in. Nothing
                is written.
        """
        name = self._known(name)
        if name == self._active:
            return {"active": name, "elements": 0 if name is None else self.elements(name)}
        self._check_untouched()
        out = self._deltas[self._active] if self._active is not None else []
        into = self._deltas[name] if name is not None else []
        try:
            saved = self._swap(out, into, self._kept.get(name))
        except Exception as e:
            what = str(e) if isinstance(e, WriteFailed) else f"a write failed ({type(e).__name__}: {e})"
            raise DeltaError(
                f"DeltaSwitch.use({name!r}): {what}; the model holds "
                f"{'the base' if self._active is None else repr(self._active)} as before."
            ) from None
        if self._active is not None:  # the base's values under it: written back, kept for its next use
            self._kept[self._active] = self._saved
        self._active, self._saved = name, saved
        return {"active": name, "elements": sum(b.entry.elements for b in into)}

    def verify(self) -> None:
        """Check every variable of the model: the base's values, bit for bit, with the active delta's in.

        ``use`` checks only the active delta's own elements (cheap); this
        reads every variable, as a fingerprint does, and finds anything else
        that wrote to the model since the switch was made (training, an
        ``assign``, a weight load).

        Raises:
            DeltaError: naming the variables that differ from the base (with
                the active delta in).
        """
        active = {id(b.variable): (b, old) for b, old in zip(self._deltas.get(self._active, []), self._saved)}
        moved = []
        for path, variable in self._every_variable:
            value = read_elements(variable, None)
            if id(variable) in active:
                b, old = active[id(variable)]
                if b.entry.index is None:
                    ok = _same_bytes(value, b.entry.values)
                    value = old
                else:
                    flat = value.reshape(-1)
                    ok = _same_bytes(np.ascontiguousarray(flat[b.entry.index]), b.entry.values)
                    flat[b.entry.index] = old
                if not ok:
                    moved.append(path)
                    continue
            if digest(value, None) != self._base[path]:
                moved.append(path)
        if moved:
            shown = ", ".join(repr(p) for p in moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            what = "the base" if self._active is None else f"the base with delta {self._active!r}"
            raise DeltaError(
                f"DeltaSwitch.verify: {len(moved)} variable(s) differ from {what}: {shown}; something wrote to "
                "the model since the switch was made. Make a new switch from a freshly loaded base."
            )

    def _swap(self, out: list[Bound], into: list[Bound], kept: list[np.ndarray] | None) -> list[np.ndarray]:
        """Take ``out`` (the active delta) out and put ``into`` in; on any failure, ``out`` is in again."""
        with owner_scope([b.variable for b in out + into]):
            try:
                _write_back(out, self._saved)
                return apply_bound(into, kept)
            except BaseException:
                for b in out:  # the active delta's values back: the model as it was
                    try:
                        write_elements(b.variable, b.entry.index, b.entry.values)
                    except Exception:  # it could not be written back, so it was never written over
                        pass
                raise

    def __repr__(self) -> str:
        return f"DeltaSwitch({', '.join(repr(n) for n in self._deltas)}; active={self._active!r})"
