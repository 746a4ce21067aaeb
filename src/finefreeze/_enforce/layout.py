"""The freeze layout: one immutable record per variable, the single source of truth.

A :class:`Layout` says, for every variable an optimizer may be built on, how
it is kept — ``train``, ``frozen``, ``restore``, ``compact`` or ``mask`` —
with its frozen-element mask and ``lr_scale``. It is made once, from a
resolution (or a saved config) and the inner optimizer's capabilities, and
everything reads it: the optimizer builds its enforcement from it, the
summary, the report and FreezeBoard show it, the config saves it. Nothing
else decides a strategy, so what is shown is what is enforced.

``compact`` hands the inner optimizer a flat vector of the trainable
elements. That changes nothing only for optimizers whose update is
elementwise (each element's step depends on its own gradient and state), so
``auto`` picks ``compact`` only for those, and an explicit ``compact`` with
any other optimizer is refused: ``auto`` changes cost, never maths. For the
same reason ``auto`` keeps ``restore`` for embeddings on TensorFlow, whose
sparse gradients Keras optimizers apply on a sparse path (an explicit
``compact`` densifies them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from finefreeze._errors import PlanError
from finefreeze._resolve.masks import ElementMask
from finefreeze._resolve.resolve import FROZEN, TRAINABLE, UNTRAINED, Resolution
from finefreeze._resolve.targets import match_path, var_path

__all__ = [
    "AUTO_COMPACT_AT_MOST",
    "ELEMENTWISE",
    "KINDS",
    "STRATEGIES",
    "Layout",
    "VarLayout",
    "compact_refusal",
    "refuse_unknown",
    "index_dtype",
]

STRATEGIES = ("auto", "restore", "compact", "mask")
KINDS = ("train", "frozen", "restore", "compact", "mask")
LAYOUT_VERSION = 2

#: ``auto`` picks ``compact`` when at most this fraction of a partially frozen
#: variable's elements train (and the optimizer is elementwise), else
#: ``restore``. Measured crossover of step time (docs/benchmarks.md, MLP,
#: graph mode): compact 0.97 vs restore 1.06 at 1 %, 1.03 vs 1.05 at 5 %,
#: 1.17 vs 1.06 at 10 %. The same crossover on ResNet50, EfficientNetB0 and a
#: transformer (benchmarks/real_models.py): compact faster at 1 %, as fast at
#: 5 %, slower at 20 %; so one rule for every layer kind.
AUTO_COMPACT_AT_MOST = 0.05

#: Keras optimizers whose update of an element depends only on that element's
#: gradient, value and state (plus global scalars such as ``iterations``), so
#: that updating a flat vector of some elements equals updating the whole
#: variable. Exact classes: a subclass may override ``update_step``. Not here:
#: Lamb (trust ratio per tensor), Adafactor (factored row/column moments, RMS
#: clipping), Muon (Newton-Schulz on matrices), ScheduleFreeAdamW (kept out as
#: its state starts as a copy of the variable), MultiOptimizer (routes by the
#: model variable's path).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion"})


def _is_elementwise(opt) -> bool:
    import keras

    cls = type(opt)
    keras_cls = getattr(keras.optimizers, cls.__name__, None)
    if cls.__name__ not in ELEMENTWISE or keras_cls is None:
        return False
    # On PyTorch, Keras builds its own subclass of the same maths (torch_adam.Adam, ...).
    return cls is keras_cls or (cls.__module__.startswith("keras.src.backend.") and issubclass(cls, keras_cls))


def compact_refusal(opt) -> str | None:
    """Why ``compact`` would change ``opt``'s maths, or None when it would not.

    Args:
        opt: the inner optimizer, or None (unknown: assumed elementwise).
    """
    if opt is None or _is_elementwise(opt):
        return None
    name = type(opt).__name__
    why = {
        "Lamb": "its trust ratio is a per-tensor norm",
        "Adafactor": "it factors second moments over rows and columns and clips by a tensor's RMS",
        "Muon": "it orthogonalizes whole matrices",
        "ScheduleFreeAdamW": "its state starts as a copy of the whole variable",
        "MultiOptimizer": "it routes each model variable by its path",
    }.get(name, "finefreeze does not know its update to be elementwise")
    return f"{name}: {why}"


def index_dtype(size: int) -> str:
    """The integer dtype of flat indices into a variable of ``size`` elements."""
    return "int32" if size <= np.iinfo(np.int32).max + 1 else "int64"


@dataclasses.dataclass(frozen=True, eq=False)
class VarLayout:
    """How one variable is kept.

    ``mask`` (True = frozen) is set for ``restore``, ``compact`` and ``mask``;
    ``scale`` is 1.0, a float, or one float32 per element of the variable.
    ``mask`` is None for a layout read from a saved config: the values arrive
    with the optimizer's variables.
    """

    path: str
    shape: tuple[int, ...]
    kind: str
    mask: ElementMask | None = None
    n_trainable: int = 0
    scale: Any = 1.0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def per_element_scale(self) -> bool:
        return isinstance(self.scale, np.ndarray)

    @property
    def enforced(self) -> bool:
        """Elements frozen inside the variable: ``restore``, ``compact`` or ``mask``."""
        return self.kind in ("restore", "compact", "mask")

    def to_config(self) -> dict:
        entry = {"path": self.path, "strategy": self.kind, "shape": list(self.shape)}
        if self.enforced:
            entry["n_trainable"] = int(self.n_trainable)
        if self.kind != "frozen":
            entry["lr_scale"] = "per-element" if self.per_element_scale else float(self.scale)
        return entry


def _sparse_gradients(owner) -> bool:
    """Whether the variable's gradient arrives sparse (TensorFlow embeddings: ``IndexedSlices``).

    Keras optimizers update such variables on their sparse path (only the
    touched rows' state moves); ``compact`` would hand them a dense vector.
    """
    import keras

    return keras.backend.backend() == "tensorflow" and isinstance(owner, keras.layers.Embedding)


def _no_int64(size: int) -> bool:
    """Whether flat indices into ``size`` elements need int64 and the backend has no int64 (JAX without x64)."""
    import keras

    if index_dtype(size) != "int64" or keras.backend.backend() != "jax":
        return False
    import jax

    return not jax.config.jax_enable_x64


def _kind(strategy: str, n_trainable: int, size: int, variable, inner, sparse: bool = False, path: str = "") -> str:
    """The concrete strategy of one partially frozen variable.

    Raises:
        PlanError: explicit ``compact`` of a variable of 2**31 elements or more on JAX without x64.
    """
    if strategy == "auto":
        small = n_trainable <= AUTO_COMPACT_AT_MOST * size
        allowed = compact_refusal(inner) is None and not _constrained(variable) and not sparse
        return "compact" if small and allowed and not _no_int64(size) else "restore"
    if strategy == "compact" and _no_int64(size):
        raise PlanError(
            f"strategy='compact' on {path!r} ({size} elements) needs int64 flat indices, and JAX runs "
            "without 64-bit integers: enable them before building the model "
            "(jax.config.update('jax_enable_x64', True)) or use strategy='restore'."
        )
    if strategy == "compact" and _constrained(variable):
        return "restore"  # a constraint acts on the whole variable
    return strategy


def _constrained(variable) -> bool:
    return getattr(variable, "constraint", None) is not None


def refuse_unknown(res: Resolution, var_list) -> None:
    """Raise unless every variable of ``var_list`` is one ``res`` was resolved against.

    Raises:
        PlanError: names the first unknown variable and how to fix it.
    """
    for v in var_list:
        if res.lookup(v) is None:
            path = var_path(v)
            if res.by_path(path) is not None:
                known = "the plan has a variable with this path, but of another model or layer"
            elif res.states:
                known = f"the plan knows {len(res.states)} variables, e.g. {res.states[0].path!r}"
            else:
                known = "the plan knows no variables"
            raise PlanError(
                f"the optimizer is being built on {path!r}, a variable its plan was not resolved "
                f"against ({known}). An optimizer wrapped by a Freezer trains that Freezer's model only: "
                "compile this model with an optimizer from its own Freezer, ff.Freezer(model, plan).wrap(...)."
            )


class Layout:
    """The layout of every variable one optimizer is built on (immutable).

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> from finefreeze._enforce.layout import Layout
        >>> w = keras.Variable(np.zeros((4, 50), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[1:]")]))
        >>> Layout.from_resolution(frz.resolution, "auto", keras.optimizers.Adam()).get(w).kind
        'restore'
        >>> Layout.from_resolution(frz.resolution, "auto", keras.optimizers.Lamb()).get(w).kind
        'restore'
    """

    def __init__(self, entries: Iterable[tuple[Any, VarLayout]], strategy: str, legacy: bool = False):
        pairs = list(entries)
        self._by_id = {id(v): e for v, e in pairs}
        self._entries = tuple({id(e): e for _, e in pairs}.values())
        self._by_path = {e.path: e for e in self._entries}
        self.strategy = strategy
        self.legacy = legacy  # a saved layout of release 1: variables it does not list train

    @classmethod
    def from_resolution(cls, res: Resolution, strategy: str, inner=None, var_list=None) -> Layout:
        """Layout of every variable of ``res`` (and ``var_list``, which must all be in ``res``).

        Raises:
            PlanError: ``strategy="compact"`` with an optimizer that is not elementwise, or a
                variable of ``var_list`` the resolution does not know.
        """
        why = compact_refusal(inner)
        if strategy == "compact" and why is not None:
            raise PlanError(
                f"strategy='compact' would change the optimizer's maths ({why}): it would see a flat "
                "vector of the trainable elements instead of the variable. Use strategy='restore' "
                "(or 'auto', which picks compact only for elementwise optimizers)."
            )
        refuse_unknown(res, var_list or ())
        pairs = []
        for s in res.states:
            kind = res.kind_of(s)
            shape = tuple(int(d) for d in s.info.shape)
            scale = s.lr_scales if s.lr_scales is not None else float(s.lr_scale)
            if kind in (FROZEN, UNTRAINED):
                entry = VarLayout(s.path, shape, "frozen")
            elif kind == TRAINABLE:
                entry = VarLayout(s.path, shape, "train", None, s.info.size, scale)
            else:
                sparse = _sparse_gradients(s.info.owner)
                k = _kind(strategy, s.n_trainable, s.info.size, s.variable, inner, sparse, s.path)
                entry = VarLayout(s.path, shape, k, s.mask, s.n_trainable, scale)
            pairs.append((s.variable, entry))
            if s.info.raw is not s.variable:
                pairs.append((s.info.raw, entry))
        return cls(pairs, strategy)

    @classmethod
    def from_config(cls, config: dict, var_list, strategy: str) -> Layout:
        """The layout a saved optimizer config records, matched to ``var_list`` by path.

        Raises:
            PlanError: a variable of ``var_list`` is not in a version-2 layout.
        """
        legacy = config.get("version", 1) < LAYOUT_VERSION
        entries = {e["path"]: e for e in config["variables"]}
        entries.update({p: {"path": p, "strategy": "frozen"} for p in config.get("frozen", ())})
        pairs = []
        for v in var_list:
            shape = tuple(int(d) for d in v.shape)
            e = match_path(var_path(v), entries, "variable (in the saved freeze layout)")
            if e is None:
                if not legacy:
                    raise PlanError(
                        f"the optimizer is being built on {var_path(v)!r}, which its saved freeze layout "
                        f"does not list (it lists {len(entries)} variables). Compile this model with an "
                        "optimizer from a Freezer of this model."
                    )
                e = {"path": var_path(v), "strategy": "train"}
            kind = e["strategy"]
            scale = e.get("lr_scale", 1.0)
            if scale == "per-element":  # the values arrive with the optimizer variables on load
                scale = np.ones(shape, np.float32)
            n = e.get("n_trainable", int(np.prod(shape, dtype=np.int64)) if kind == "train" else 0)
            pairs.append((v, VarLayout(var_path(v), shape, kind, None, int(n), scale)))
        return cls(pairs, strategy, legacy)

    def to_config(self) -> dict:
        return {"version": LAYOUT_VERSION, "variables": [e.to_config() for e in self._entries]}

    def get(self, variable) -> VarLayout | None:
        """The entry of ``variable`` (by identity), or None."""
        e = self._by_id.get(id(variable))
        if e is None and hasattr(variable, "value"):
            e = self._by_id.get(id(variable.value))
        return e

    def by_path(self, path: str) -> VarLayout | None:
        return self._by_path.get(path)

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def kinds(self) -> dict[str, str]:
        """``{path: kind}`` of every variable."""
        return {e.path: e.kind for e in self._entries}
