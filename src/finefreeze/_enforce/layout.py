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

from finefreeze._enforce.policy import choose_kind, compact_refusal, sparse_gradients
from finefreeze._errors import PlanError
from finefreeze._kinds import KINDS, Kind
from finefreeze._resolve.masks import ElementMask
from finefreeze._resolve.resolve import FROZEN, TRAINABLE, UNTRAINED, Resolution
from finefreeze._resolve.standins import is_standin, kernel_of
from finefreeze._resolve.targets import match_path, var_path
from finefreeze._slices.choose import exact_block, slice_eligible, sliced_gradient, standin_of
from finefreeze._version import __version__

__all__ = [
    "LAYOUT_VERSION",
    "Layout",
    "VarLayout",
    "check_saved",
    "refuse_unknown",
    "saved_problem",
]

#: the ``version`` of a saved layout: the one format this version writes and reads
LAYOUT_VERSION = 1


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
    # compact of a sliced kernel whose trained elements are exactly a block of ranges: taken by slices
    block: tuple | None = None
    # the variable of the trained elements a sliced layer hands their gradient to (``compact``'s vector),
    # and that layer (whose call says, as each step is traced, whether it hands it: held dense, it does not)
    standin: Any = None
    owner: Any = None
    # a quantized kernel's: the stand-in is a float delta beside the integers, never read from or written to them
    delta: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def per_element_scale(self) -> bool:
        return isinstance(self.scale, np.ndarray)

    @property
    def enforced(self) -> bool:
        """Elements frozen inside the variable: ``restore``, ``compact`` or ``mask``."""
        return KINDS[self.kind].enforced

    def to_config(self) -> dict:
        entry = {"path": self.path, "kind": self.kind, "shape": list(self.shape)}
        if self.enforced:
            entry["n_trainable"] = int(self.n_trainable)
        if self.kind != Kind.FROZEN:
            entry["lr_scale"] = "per-element" if self.per_element_scale else float(self.scale)
        return entry


def refuse_unknown(res: Resolution, var_list) -> None:
    """Raise unless every variable of ``var_list`` is one ``res`` was resolved against (or a stand-in of one).

    Raises:
        PlanError: names the first unknown variable and how to fix it.
    """
    for v in var_list:
        kernel = kernel_of(v)
        if res.lookup(v) is None and (kernel is None or res.lookup(kernel) is None):
            path = var_path(v)
            layer = path.rsplit("/", 1)[0] + "/"
            if res.by_path(path) is None and any(s.path.startswith(layer) for s in res.states):
                raise PlanError(
                    f"the optimizer is being built on {path!r}, a variable made after its Freezer: the plan "
                    f"knows other variables of {layer[:-1]!r}, not this one (enable_lora, or a layer built "
                    "later?). Make the Freezer and its optimizer after the model has all its variables: "
                    "ff.Freezer(model, plan).wrap(...)."
                )
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


def saved_problem(config) -> str | None:
    """What keeps ``config`` from being a saved layout of format :data:`LAYOUT_VERSION`, or None."""
    version = config.get("version") if isinstance(config, dict) else None
    if version is None:
        return "has no format version"
    if version != LAYOUT_VERSION:
        return f"is format {version!r}"
    if not _well_formed(config.get("variables")):
        return f"is format {version!r} but lacks entries that format holds"
    return None


def check_saved(config) -> None:
    """Raise unless ``config``, a model file's saved layout, is of format :data:`LAYOUT_VERSION`.

    Raises:
        PlanError: names the file, the format found and the one this version reads, and how to save it again.
    """
    problem = saved_problem(config)
    if problem is not None:
        raise PlanError(
            f"the freeze layout in this model file's optimizer config {problem}; finefreeze {__version__} reads "
            f"format {LAYOUT_VERSION} only. Save the model again with finefreeze {__version__}: "
            "keras.models.load_model(path, compile=False), compile it with ff.Freezer(model, plan).wrap(optimizer), "
            "then model.save(path)."
        )


def _well_formed(entries) -> bool:
    """Whether ``entries`` are the variables of a saved layout: each with a path, a kind and a shape."""
    return isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and e.get("kind") in tuple(KINDS) and "shape" in e
        for e in entries
    )


def _twins(entries: dict, paths: list[str]) -> dict[str, list[dict]]:
    """Entries of variables whose Keras path several variables share, in order, by that path.

    Twin towers save their variables under scoped paths (``left/body/kernel``,
    ``right/body/kernel``) while Keras calls both ``body/kernel``; both lists
    follow the model's weight order, so the k-th variable of a shared path
    takes the k-th entry that ends with it.
    """
    out = {}
    for path in {p for p in paths if paths.count(p) > 1}:
        near = [e for k, e in entries.items() if k.endswith("/" + path)]
        if len(near) == paths.count(path):
            out[path] = near
    return out


class Layout:
    """The layout of every variable one optimizer is built on (immutable).

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> from finefreeze._enforce.layout import Layout
        >>> w = keras.Variable(np.zeros((4, 50), "float32"), name="w")
        >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[1:]")]))
        >>> Layout.from_resolution(frz._res, "auto", keras.optimizers.Adam()).get(w).kind
        'restore'
        >>> Layout.from_resolution(frz._res, "auto", keras.optimizers.Lamb()).get(w).kind
        'restore'
    """

    def __init__(self, entries: Iterable[tuple[Any, VarLayout]], strategy: str):
        pairs = list(entries)
        self._by_id = {id(v): e for v, e in pairs}
        self._entries = tuple({id(e): e for _, e in pairs}.values())
        self._by_path = {e.path: e for e in self._entries}
        self.strategy = strategy

    @classmethod
    def from_resolution(cls, res: Resolution, strategy: str, inner=None, var_list=None) -> Layout:
        """Layout of every variable of ``res`` (and ``var_list``, which must all be in ``res``).

        Raises:
            PlanError: ``strategy="compact"`` with an optimizer that is not elementwise and a
                partially frozen variable, or a
                variable of ``var_list`` the resolution does not know.
        """
        why = compact_refusal(inner)
        partial = any(res.kind_of(s) not in (FROZEN, UNTRAINED, TRAINABLE) for s in res.states)
        if strategy == "compact" and why is not None and partial:  # nothing partial: nothing is compacted
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
                entry = VarLayout(s.path, shape, Kind.FROZEN)
            elif kind == TRAINABLE:
                entry = VarLayout(s.path, shape, Kind.TRAIN, None, s.info.size, scale)
            else:
                # a sparse or sliced gradient: compact's step costs the trained part, restore's the whole variable
                cheap = sparse_gradients(s.info.owner) or slice_eligible(s.info.owner, s.variable) is not None
                delta = s.info.quantized is not None  # its delta is the only state it has: compact's vector
                k = (
                    Kind.COMPACT
                    if delta
                    else choose_kind(strategy, s.n_trainable, s.info.size, s.variable, inner, cheap, s.path)
                )
                sliced = sliced_gradient(s.info.owner, s.variable) is not None  # held dense: flat indices, no retrace
                block = exact_block(s.mask.dense()) if sliced and k == Kind.COMPACT and not delta else None
                standin = standin_of(s.info.owner, s.variable)
                owner = s.info.owner if standin is not None else None
                entry = VarLayout(s.path, shape, k, s.mask, s.n_trainable, scale, block, standin, owner, delta)
            pairs.append((s.variable, entry))
            if s.info.raw is not s.variable:
                pairs.append((s.info.raw, entry))
        return cls(pairs, strategy)

    @classmethod
    def from_config(cls, config: dict, var_list, strategy: str) -> Layout:
        """The layout a saved optimizer config records, matched to ``var_list`` by path.

        Raises:
            PlanError: a layout of another format (:func:`check_saved`), or a variable of
                ``var_list`` the layout does not list.
        """
        check_saved(config)
        entries = {e["path"]: e for e in config["variables"]}
        pairs = []
        var_list = [v for v in var_list if not is_standin(v)]  # stand-ins are their kernels' (the Freezer's)
        twins = _twins(entries, [var_path(v) for v in var_list])
        for v in var_list:
            shape = tuple(int(d) for d in v.shape)
            path = var_path(v)
            e = (
                twins[path].pop(0)
                if path in twins
                else match_path(path, entries, "variable (in the saved freeze layout)")
            )
            if e is None:
                raise PlanError(
                    f"the optimizer is being built on {var_path(v)!r}, which its saved freeze layout "
                    f"does not list (it lists {len(entries)} variables). Compile this model with an "
                    "optimizer from a Freezer of this model."
                )
            kind = e["kind"]
            scale = e.get("lr_scale", 1.0)
            if scale == "per-element":  # the values arrive with the optimizer variables on load
                scale = np.ones(shape, np.float32)
            n = e.get("n_trainable", int(np.prod(shape, dtype=np.int64)) if kind == Kind.TRAIN else 0)
            pairs.append((v, VarLayout(e["path"] if path in twins else path, shape, kind, None, int(n), scale)))
        return cls(pairs, strategy)

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

    def standins(self) -> dict[int, VarLayout]:
        """``{id(stand-in): entry of its kernel}`` of every entry with a stand-in."""
        return {id(e.standin): e for e in self._entries if e.standin is not None}

    def kinds(self) -> dict[str, str]:
        """``{path: kind}`` of every variable."""
        return {e.path: e.kind for e in self._entries}
