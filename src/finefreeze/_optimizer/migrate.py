"""Carry an inner optimizer's state across a plan change, keyed by variable identity.

Keras optimizers make their per-variable state in ``build`` with
``add_variable_from_reference(variable, name)``. :func:`build_recording`
builds the inner optimizer while recording which state variable was made for
which variable it is built on (by identity, never by name), so a plan change
can:

- keep the state of every element that trains before and after it;
- give elements that start training fresh state: what Keras itself gives at
  build — zero moments, Adagrad's and Ftrl's ``initial_accumulator_value``,
  and an EMA average (or ScheduleFreeAdamW's ``z`` copy) equal to the
  element's value;
- release the state of what stops training (it is not rebuilt);
- keep global state (``iterations``, the learning rate or its schedule, and
  anything built for no variable in particular, such as Nadam's
  ``u_product``).

The inner optimizer is never cloned or replaced: :func:`unbuild` empties it
back to what its constructor made, and it is built again on the new list.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import keras
import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.variables import host_constant
from finefreeze._enforce.policy import family
from finefreeze._keras.instances import patched
from finefreeze._keras.optimizers import own_variables, retrack, untrack
from finefreeze._keras.optimizers import unbuild as keras_unbuild

__all__ = [
    "StateMap",
    "build_recording",
    "carry",
    "constructor_variables",
    "family",
    "retrack",
    "snapshot",
    "unbuild",
    "untrack",
]


def constructor_variables(opt) -> set[int]:
    """Ids of the variables ``opt`` (and its sub-optimizers) hold before any build."""
    return {id(w) for o in family(opt) for w in own_variables(o)}


def unbuild(opt, keep: set[int]) -> None:
    """Return ``opt`` to its unbuilt state, keeping the variables in ``keep`` (iterations, learning rate)."""
    for o in family(opt):
        untrack(o, [w for w in own_variables(o) if id(w) not in keep])
        keras_unbuild(o)


@dataclasses.dataclass
class StateMap:
    """Which inner-optimizer variables hold state of which variable it is built on."""

    per_element: dict[int, list[tuple[str, Any, Any]]]  # id(var) -> [(name, state, (owner optimizer, initializer))]
    per_variable: dict[int, list[tuple[str, Any]]]  # id(var) -> [(key, state)] of other shapes (Adafactor r, c)
    other: list[Any]  # built for no variable in particular (Nadam's u_product)


def build_recording(opt, var_list: list) -> StateMap:
    """Build ``opt`` on ``var_list`` and record the state it makes for each variable."""
    per_element: dict[int, list] = {}
    per_variable: dict[int, list] = {}
    made: list = []
    before = {id(w) for o in family(opt) for w in own_variables(o)}

    def recording(o) -> dict:
        add_variable = o.add_variable
        from_reference = o.add_variable_from_reference
        current: list = []

        def recording_add_variable(*args, **kwargs):
            # a constant state (zeros) made on the host: JAX compiles ``zeros`` once per shape, and keeps it
            if len(args) > 1:
                args = (args[0], host_constant(args[1]), *args[2:])
            else:
                kwargs["initializer"] = host_constant(kwargs.get("initializer", "zeros"))
            w = add_variable(*args, **kwargs)
            (current[-1][1] if current else made).append(w)
            return w

        def recording_from_reference(reference_variable, name=None, initializer="zeros"):
            current.append((reference_variable, []))
            try:
                w = from_reference(reference_variable, name, initializer)
            finally:
                ref, got = current.pop()
            # Plain add_variable calls made just before, named after this variable,
            # belong to it (Adafactor's factored r and c).
            mine = [m for m in made if getattr(m, "name", None) == getattr(ref, "name", object())]
            for k, m in enumerate(mine):
                made.remove(m)
                per_variable.setdefault(id(ref), []).append((f"{m.name}#{k}", m))
            for g in got:
                per_element.setdefault(id(ref), []).append((name or "var", g, (o, initializer)))
            return w

        return {"add_variable": recording_add_variable, "add_variable_from_reference": recording_from_reference}

    with contextlib.ExitStack() as stack:
        for o in family(opt):
            stack.enter_context(patched(o, **recording(o)))
        opt.build(var_list)
    recorded = {id(w) for ws in per_element.values() for _, w, _ in ws}
    recorded |= {id(w) for ws in per_variable.values() for _, w in ws}
    other = [w for o in family(opt) for w in own_variables(o) if id(w) not in before and id(w) not in recorded]
    return StateMap(per_element, per_variable, other)


def _fresh(name: str, made_by, values: np.ndarray, dtype) -> np.ndarray:
    """The state Keras gives an element at build: a copy of its value, or what the initializer says.

    EMA averages (``average``) and ScheduleFreeAdamW's ``momentum`` start as the
    variable; Adagrad's and Ftrl's accumulators at ``initial_accumulator_value``;
    most state at zero.
    """
    owner, initializer = made_by
    if name == "average" or (name == "momentum" and type(owner).__name__ == "ScheduleFreeAdamW"):
        return values.astype(dtype)
    init = keras.initializers.get(host_constant(initializer))
    return np.asarray(keras.ops.convert_to_numpy(init((values.size,), dtype=str(dtype)))).astype(dtype)


@dataclasses.dataclass
class Held:
    """State of one variable's trained elements, read before a plan change."""

    elements: np.ndarray  # sorted flat indices of the elements the values belong to
    per_element: dict[str, np.ndarray]
    per_variable: dict[str, np.ndarray]
    born: np.ndarray | None = None  # the release step of each of ``elements`` (None: all trained from step 0)


def snapshot(state: StateMap, inner_variable, elements: np.ndarray, compact: bool) -> Held:
    """The state ``state`` holds for ``inner_variable``, restricted to ``elements`` (its trained ones)."""
    pick = slice(None) if compact else elements
    per_el = {n: to_numpy(w).reshape(-1)[pick].copy() for n, w, _ in state.per_element.get(id(inner_variable), [])}
    per_var = {k: to_numpy(w).copy() for k, w in state.per_variable.get(id(inner_variable), [])}
    return Held(elements, per_el, per_var)


def carry(state: StateMap, inner_variable, elements: np.ndarray, values: np.ndarray, held: Held | None) -> None:
    """Give ``inner_variable``'s state the held values for elements that kept training; fresh state elsewhere.

    Args:
        state: the map of the inner optimizer as built now.
        inner_variable: what the inner optimizer updates (the variable, or a compact vector).
        elements: flat indices of the model elements behind the state, in state order.
        values: the model variable's current values at ``elements``.
        held: the state before the change, or None (nothing trained before).
    """
    old_idx = held.elements if held is not None else np.zeros(0, np.int64)
    if old_idx.size:
        pos = np.minimum(np.searchsorted(old_idx, elements), old_idx.size - 1)
        kept = old_idx[pos] == elements
    else:
        pos, kept = np.zeros(elements.size, np.int64), np.zeros(elements.size, bool)
    for name, w, made_by in state.per_element.get(id(inner_variable), []):
        dtype = np.dtype(w.dtype)
        fresh = _fresh(name, made_by, values, dtype)
        out = (
            np.where(kept, held.per_element[name][pos], fresh)
            if held is not None and name in held.per_element
            else fresh
        )
        w.assign(out.reshape(w.shape))
    if held is not None:
        for key, w in state.per_variable.get(id(inner_variable), []):
            got = held.per_variable.get(key)
            if got is not None and got.shape == tuple(w.shape):
                w.assign(got)


def keyed(variables) -> dict:
    """Variables by ``(name, shape, occurrence)`` (names repeat: unnamed ones are variable, variable_1, ...)."""
    out, seen = {}, {}
    for w in variables:
        k = (re.sub(r"_\d+$", "", w.name), tuple(int(d) for d in w.shape))
        seen[k] = seen.get(k, 0) + 1
        out[(*k, seen[k])] = w
    return out
