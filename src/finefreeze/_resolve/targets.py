"""Collect the variables of a target (Keras layer/model, tf.Module, list).

Each variable becomes a :class:`VarInfo` with its path, aliases, owning layer
and the trainable state it had before any Freezer touched it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from finefreeze._backends.questions import tensorflow_imported
from finefreeze._backends.read import read
from finefreeze._backends.variables import backend_variable
from finefreeze._errors import PlanError
from finefreeze._keras.instances import set_tag, tag
from finefreeze._keras.layers import (
    embeddings_variable,
    kernel_variable,
    lora_enabled_layers,
    module_variables,
    own_weights,
    sublayers,
)
from finefreeze._keras.quantized import QUANTIZED_KINDS, is_quantized, logical_shape, reverse_table
from finefreeze._resolve.scopes import drop_ambiguous_aliases, scoped_aliases
from finefreeze._resolve.standins import is_standin_layer

__all__ = ["VarInfo", "Target", "collect", "quantization_note", "var_path"]

_BASE_ATTR = "_finefreeze_base_trainable"


def var_path(v) -> str:
    """Keras path of a variable, or a raw ``tf.Variable``'s name without ``:N``."""
    p = getattr(v, "path", None)
    if isinstance(p, str) and p:
        return p
    name = getattr(v, "name", "") or ""
    return name.rsplit(":", 1)[0] if ":" in name else name


def match_path(path: str, by_path: dict, what: str = "variable"):
    """The value stored under ``path``, allowing one model-name prefix more or less.

    Saved and reloaded models disagree on that prefix (a reloaded Sequential
    drops its own name), so an exact match wins, then a unique match that
    differs by leading path segments.

    Raises:
        PlanError: several entries match only by suffix.
    """
    if path in by_path:
        return by_path[path]
    near = [k for k in by_path if k.endswith("/" + path) or path.endswith("/" + k)]
    if len(near) > 1:
        raise PlanError(f"{what} {path!r} matches several entries ({', '.join(near)}); give layers unique names.")
    return by_path[near[0]] if near else None


def base_trainable(obj) -> bool:
    """The ``trainable`` flag of a variable or layer before finefreeze set it."""
    was = tag(obj, _BASE_ATTR, None)
    return bool(getattr(obj, "trainable", True)) if was is None else was


def _lora_base(layer, v) -> bool:
    """Whether ``v`` is the base kernel (or embedding table) of ``layer`` with LoRA enabled.

    Keras' and KerasHub's ``enable_lora`` switch that variable's ``trainable``
    flag off; unlike a moving statistic it is a weight a plan may train. A
    KerasHub backbone's ``enable_lora`` also switches off every other layer
    of the backbone (it records ``_lora_enabled_layers``): their weights,
    made trainable, are plan targets too; statistics and seeds, made
    non-trainable, are not.
    """
    return bool(getattr(layer, "lora_enabled", False)) and any(
        w is v for w in (kernel_variable(layer), embeddings_variable(layer))
    )


def remember_base(obj) -> None:
    if tag(obj, _BASE_ATTR, None) is None:
        try:
            set_tag(obj, _BASE_ATTR, bool(obj.trainable))
        except AttributeError:  # pragma: no cover - objects without __dict__
            pass


@dataclasses.dataclass(eq=False)
class VarInfo:
    path: str
    names: tuple[str, ...]  # path first, then aliases
    variable: Any  # what the user and optimizer see (keras.Variable or tf.Variable)
    raw: Any  # the backend's variable inside it (backend_variable: tf.Variable, Parameter), or itself
    shape: tuple[int, ...]
    dtype: str
    owner: Any  # owning layer / module, or None
    base_trainable: bool  # a plan target: Keras trains it, or a library switched it off (switched_off)
    is_keras: bool
    switched_off: bool = False  # Keras does not train it now, but it is no statistic: a LoRA base kernel
    # the quantization mode of a quantized kernel (int8, int4): ``shape`` is the float kernel's, and what trains
    # of it is a float delta beside it (``_slices.quantized``); None for every other variable
    quantized: str | None = None
    # a statistic Keras overwrites with each step's "gradient" (``overwrite_with_gradient``: float8's scales
    # and amax histories): outside plans, it trains while its layer does (``resolve``)
    overwritten: bool = False

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def numpy(self):
        """The variable's current value as a numpy array (``where=`` reads it).

        Raises:
            PlanError: a quantized kernel (its stored integers are not its values).
        """
        if self.quantized is not None:
            raise PlanError(
                f"{self.path!r} is an {self.quantized}-quantized kernel (logical shape {self.shape}): a mask made from "
                "its values (where=) cannot read them as floats. Make the mask on the float model before "
                "quantize() (the same plan applies after it), or give indices, fractions or a mask array."
            )
        return read(self.variable)


@dataclasses.dataclass(eq=False)
class Target:
    obj: Any
    kind: str  # "keras" | "module" | "variables"
    variables: list[VarInfo]
    layers: list[Any]  # every layer / submodule, deduplicated
    # a scoped name (a nested layer's name added to a path) that names several variables
    ambiguous: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.name_index = None  # every name joined once, for selectors that match all variables at once
        self._class_ids: dict = {}
        self._inst_ids: dict = {}

    def class_weight_ids(self, cls) -> frozenset:
        key = cls if isinstance(cls, str) else id(cls)
        if key not in self._class_ids:
            ids = set()
            for layer in self.layers:
                if _is_instance(layer, cls):
                    ids.update(id(v) for v in _layer_weights(layer))
            self._class_ids[key] = frozenset(ids)
        return self._class_ids[key]

    def instance_weight_ids(self, obj) -> frozenset:
        if id(obj) not in self._inst_ids:
            self._inst_ids[id(obj)] = frozenset(id(v) for v in _layer_weights(obj))
        return self._inst_ids[id(obj)]


def _is_instance(layer, cls) -> bool:
    if isinstance(cls, str):
        return any(c.__name__ == cls for c in type(layer).__mro__)
    return isinstance(layer, cls)


def _layer_weights(obj):
    w = getattr(obj, "weights", None)
    if w is None:
        w = getattr(obj, "variables", ())
    return list(w)


def _shape_dtype(v):
    shape = tuple(map(int, v.shape))
    dt = v.dtype
    return shape, dt if isinstance(dt, str) else (getattr(dt, "name", None) or str(dt))


def collect(target) -> Target:
    """Build a :class:`Target` from a Keras layer/model, tf.Module or list.

    Raises:
        PlanError: an unsupported target, or two variables with one path.
    """
    import keras

    if isinstance(target, keras.layers.Layer):
        t = _collect_keras(target)
    elif isinstance(target, (list, tuple)):
        t = _collect_list(target)
    else:
        tf = tensorflow_imported()
        if tf is not None and isinstance(target, tf.Module):
            t = _collect_module(target)
        else:
            raise PlanError(
                f"cannot freeze a {type(target).__name__}: the target must be a "
                "Keras model or layer, a tf.Module, or a list of variables."
            )
    seen: dict[str, VarInfo] = {}
    for vi in t.variables:
        other = seen.get(vi.path)
        if other is not None:
            raise PlanError(
                f"two different variables share the path {vi.path!r} (shapes "
                f"{other.shape} and {vi.shape}); paths must identify one variable. "
                "Give the variables or their layers unique names."
            )
        seen[vi.path] = vi
    if not t.variables:
        raise PlanError(
            f"the target {type(target).__name__} has no variables; build the model "
            "(call it once or use an Input) before creating a Freezer."
        )
    return t


def _collect_keras(root) -> Target:

    infos: list[VarInfo] = []
    seen: set[int] = set()
    layers: list = []
    layer_ids: set[int] = set()
    root_trainable = base_trainable(root)

    def walk(layer, scope, lora_root=False):
        if id(layer) in layer_ids:
            return
        layer_ids.add(id(layer))
        layers.append(layer)
        lora_root = lora_root or bool(lora_enabled_layers(layer))  # KerasHub's enable_lora
        weights, statistics = own_weights(layer)
        for v in weights + statistics:
            if id(v) in seen:
                continue
            seen.add(id(v))
            shape, dtype = _shape_dtype(v)
            path = var_path(v)
            made_trainable = any(v is w for w in weights)  # a weight, not a statistic or a seed
            off = not base_trainable(v) and (_lora_base(layer, v) or (lora_root and made_trainable))
            own = v is kernel_variable(layer) or v is embeddings_variable(layer) or v is reverse_table(layer)
            mode = is_quantized(layer) if own else None
            if mode in QUANTIZED_KINDS:  # a plan addresses it by the float kernel's shape and trains a delta
                shape, dtype, off = logical_shape(layer, v), layer.variable_dtype, True
            else:
                mode = None
            infos.append(
                VarInfo(
                    path=path,
                    names=(path, *scoped_aliases(path, scope)),
                    variable=v,
                    raw=backend_variable(v),  # not JAX's value: it would keep an old buffer alive
                    shape=shape,
                    dtype=dtype,
                    owner=layer,
                    base_trainable=root_trainable and (base_trainable(v) or off),
                    is_keras=True,
                    switched_off=off,
                    quantized=mode,
                    overwritten=bool(getattr(v, "overwrite_with_gradient", False)),
                )
            )
        for sub in sublayers(layer):
            if not is_standin_layer(sub):  # a sliced kernel's trained elements: the Freezer's, never a target's
                walk(sub, (*scope, sub.name), lora_root)

    walk(root, ())
    order = {id(v): i for i, v in enumerate(root.weights)}
    infos.sort(key=lambda vi: order.get(id(vi.variable), len(order)))
    _scope_twins(infos)
    ambiguous = drop_ambiguous_aliases(infos)
    return Target(root, "keras", infos, layers, ambiguous)


def _scope_twins(infos: list[VarInfo]) -> None:
    """Variables whose Keras paths coincide (two towers of one architecture) take their scoped names as paths.

    Keras names ``left/body/kernel`` and ``right/body/kernel`` both
    ``body/kernel`` when the towers were built before the model that holds
    them. Names are scopes: each takes its scoped alias as its path, and the
    shared Keras path stays a name of both (dropped as ambiguous, so a rule
    written with it says which scoped names to use). Twins without distinct
    scoped names are left for :func:`collect` to refuse.
    """
    by_path: dict[str, list[VarInfo]] = {}
    for vi in infos:
        by_path.setdefault(vi.path, []).append(vi)
    real = set(by_path)
    for path, group in by_path.items():
        if len(group) < 2:
            continue
        scoped = [vi.names[1] if len(vi.names) > 1 else None for vi in group]
        if None in scoped or len(set(scoped)) < len(scoped) or real & set(scoped):
            continue
        for vi, name in zip(group, scoped):
            vi.path, vi.names = name, (name, path, *vi.names[2:])


def _collect_list(variables) -> Target:
    import keras

    tf = None
    infos = []
    seen = set()
    for i, v in enumerate(variables):
        if isinstance(v, keras.Variable):
            raw, is_keras = backend_variable(v), True
        else:
            tf = tf or tensorflow_imported()
            if tf is None or not isinstance(v, tf.Variable):
                raise PlanError(
                    f"target list item {i} is a {type(v).__name__}, not a variable; "
                    "pass keras.Variable or tf.Variable objects."
                )
            raw, is_keras = v, False
        if id(v) in seen:
            continue
        seen.add(id(v))
        shape, dtype = _shape_dtype(v)
        p = var_path(v)
        infos.append(VarInfo(p, (p,), v, raw, shape, dtype, None, base_trainable(v), is_keras))
    return Target(list(variables), "variables", infos, [])


def _collect_module(module) -> Target:
    tf = tensorflow_imported()
    import keras

    pairs = module_variables(module, lambda x: isinstance(x, (tf.Variable, keras.Variable)))
    by_id: dict[int, list] = {}
    order: list = []
    for path, v in pairs:
        if id(v) not in by_id:
            by_id[id(v)] = [v, []]
            order.append(id(v))
        by_id[id(v)][1].append("/".join(str(p) for p in path))
    name_count: dict[str, int] = {}
    for vid in order:
        p = var_path(by_id[vid][0])
        name_count[p] = name_count.get(p, 0) + 1
    infos = []
    for vid in order:
        v, attr_paths = by_id[vid]
        name = var_path(v)
        # A name shared by several variables identifies none of them: the
        # attribute path becomes the path, and the name is not an alias.
        names = ([name] if name_count[name] == 1 else []) + attr_paths
        shape, dtype = _shape_dtype(v)
        is_keras = isinstance(v, keras.Variable)
        infos.append(
            VarInfo(names[0], tuple(names), v, backend_variable(v), shape, dtype, None, base_trainable(v), is_keras)
        )
    layers = [module] + list(module.submodules)
    return Target(module, "module", infos, layers)


def quantization_note(target: Target, paths: list[str]) -> str:
    """A note when one of ``paths`` is the kernel of a layer quantized in a mode no plan trains (gptq, awq), or ""."""
    for vi in target.variables:
        mode = is_quantized(vi.owner) if vi.path in paths and vi.path.endswith("kernel") else None
        if mode is not None and mode not in QUANTIZED_KINDS:
            return (
                f" ({vi.path!r} holds the {mode}-quantized integers of its layer's kernel: a plan trains a part of "
                f"a kernel quantized to {' or '.join(QUANTIZED_KINDS)}, as a float delta beside it, never of a "
                f"{mode} one; quantize the layer with one of those, or train other variables)"
            )
    return ""
