"""The record a ``FreezingOptimizer`` saves beside its variables, so a checkpoint resumes across plan changes.

Keras saves an optimizer's variables by position (``"0"``, ``"1"``, ...) and
loads them only into an optimizer with as many variables; otherwise it warns
("Skipping variable loading for optimizer") and the state restarts. A run
restarted after a crash builds its optimizer for the plan it starts with,
while the checkpoint holds the state of the plan in force when it was
written (``GradualUnfreezing`` may have released three blocks since). So the
optimizer writes one more entry, :data:`KEY`: a JSON record of the layout in
force, the plan, the step, and where each enforcer's mask, index and scale
(and release steps, see ``optimizer.ages``) sit among the saved variables. On load the record gives the saved masks, the
Freezer puts exactly those in force (resolution, Keras flags, layout, inner
optimizer rebuilt on the same variables), and then every variable loads by
position, bit for bit.

A store without the record is loaded by position, as Keras loads its own
optimizers: the checkpoint of a plain Keras optimizer, or of a
``FreezingOptimizer`` saved before its first step (not built yet, it has
no layout to record).
"""

from __future__ import annotations

import contextlib
import json
import warnings

import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._enforce.layout import saved_problem
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._kinds import Kind
from finefreeze._version import __version__

__all__ = [
    "KEY",
    "born_as_saved",
    "enforced",
    "load",
    "load_plain",
    "masks",
    "positional_keys",
    "read",
    "record",
    "write",
]

#: the store entry of the record (Keras' own entries are "0", "1", ...)
KEY = "finefreeze_checkpoint"
#: the record's ``version``: the one format this version writes and reads
VERSION = 1
#: what a record of :data:`VERSION` holds
_KEYS = ("layout", "slots", "plan", "step", "gradients")
_SLOTS = ("mask", "index", "scale", "born", "u_product")


def record(opt, variables) -> dict:
    """The record of a built optimizer whose saved variables are ``variables`` (in order)."""
    where = {id(w): i for i, w in enumerate(variables)}
    slots = {}
    for e in opt._enforcers:
        mine = {name: where[id(getattr(e, name))] for name in _SLOTS if getattr(e, name) is not None}
        if mine:
            slots[e.path] = mine
    config = opt.get_config()
    return {
        "version": VERSION,
        "layout": opt._layout.to_config(),
        "slots": slots,
        "plan": config["plan"],
        "step": int(to_numpy(opt.iterations)),
        "gradients": config["gradients"],  # the kernels held dense: a resumed run computes what this one did
    }


def write(store, rec: dict) -> None:
    store[KEY] = np.frombuffer(json.dumps(rec).encode("utf-8"), np.uint8)


def read(store) -> dict | None:
    """The record in ``store``, or None (no record: a plain Keras optimizer's, or one saved before its first step).

    Raises:
        PlanError: a record of another format than :data:`VERSION`, or one
            that lacks what that format holds; nothing is loaded.
    """
    if store is None or KEY not in store.keys():
        return None
    try:
        rec = json.loads(np.asarray(store[KEY], np.uint8).tobytes().decode("utf-8"))
    except ValueError:  # not UTF-8 or not JSON
        rec = None
    problem = _problem(rec)
    if problem is not None:
        raise PlanError(
            f"the checkpoint's freeze record ({KEY!r}, beside the optimizer's variables) {problem}; finefreeze "
            f"{__version__} reads format {VERSION} only. Resume from a checkpoint saved with finefreeze "
            f"{__version__}, or start the run again: it saves new checkpoints."
        )
    return rec


def _problem(rec) -> str | None:
    """What keeps ``rec`` from being a record of format :data:`VERSION`, or None."""
    version = rec.get("version") if isinstance(rec, dict) else None
    if version is None:
        return "has no format version"
    if version != VERSION:
        return f"is format {version!r}"
    missing = [k for k in _KEYS if k not in rec]
    if missing:
        return f"is format {version!r} but lacks {', '.join(missing)}"
    layout = saved_problem(rec["layout"])
    return None if layout is None else f"is format {version!r} but its layout {layout}"


def positional_keys(store) -> list[str]:
    """Keras' own entries of ``store``: the variables by position."""
    return [k for k in store.keys() if k != KEY]


def masks(rec: dict, store) -> dict[str, tuple[str, np.ndarray | None, np.ndarray | float]]:
    """``{path: (kind, frozen mask or None, scale)}`` as the saving optimizer enforced them.

    The same form as ``finefreeze._freezer.reload`` reads from a built optimizer.
    """
    out = {}
    for entry in rec["layout"]["variables"]:
        path, kind, shape = entry["path"], entry["kind"], tuple(entry["shape"])
        if kind == Kind.FROZEN:
            out[path] = ("frozen", None, 1.0)
            continue
        slots = rec["slots"].get(path, {})
        arrays = {name: np.asarray(store[str(i)]) for name, i in slots.items()}
        default = entry.get("lr_scale", 1.0)
        out[path] = enforced(shape, arrays.get("mask"), arrays.get("index"), arrays.get("scale"), default)
    return out


def enforced(shape, mask, index, scale, default=1.0) -> tuple[str, np.ndarray | None, np.ndarray | float]:
    """``(kind, frozen mask or None, scale)`` from an enforcer's mask, compact index and scale values.

    Args:
        shape: the model variable's shape.
        mask: the bool frozen mask (``restore``, ``mask``), or None.
        index: the flat indices of the trainable elements (``compact``), or None.
        scale: the ``lr_scale`` values (a scalar, one per element, or one per
            compact element), or None for ``default``.
        default: the layout's scale when no scale values exist (``"per-element"`` counts as 1).
    """
    frozen = None
    if mask is not None:
        frozen = np.asarray(mask).astype(bool).reshape(shape)
    elif index is not None:
        index = np.asarray(index).astype(np.int64)
        frozen = np.ones(int(np.prod(shape, dtype=np.int64)), bool)
        frozen[index] = False
        frozen = frozen.reshape(shape)
    out: np.ndarray | float = 1.0 if default == "per-element" else float(default)
    if scale is not None:
        s = np.asarray(scale).astype(np.float32)
        if s.ndim == 0:
            out = float(s)
        elif index is not None:  # compact: one value per trainable element
            full = np.ones(frozen.size, np.float32)
            full[index] = s
            out = full.reshape(shape)
        else:
            out = s.reshape(shape)
    return ("partial" if frozen is not None else "train", frozen, out)


def load(opt, state, store, frz) -> bool:
    """Load ``store`` into ``opt`` through its record; False when Keras' own loading should run instead.

    With a record and a Freezer, the saved masks are put in force first, so
    the variables line up by position; then the frozen baseline is taken
    from the weights just loaded (the model's layers load before its
    optimizer). Without a Freezer (an optimizer loaded with its model, whose
    config already holds the saved layout) or a record, Keras loads by
    position as usual.
    """
    rec = read(store)
    if rec is None:
        return False
    if frz is None:
        born_as_saved(state, rec, store)
        keys = positional_keys(store)
        if len(keys) != len(opt._stored_variables()):
            warnings.warn(
                f"Skipping variable loading for optimizer {opt.name!r}: it has {len(opt._stored_variables())} variables "
                f"and the checkpoint {len(keys)}; a checkpoint written after a plan change loads into an "
                "optimizer made by a Freezer (frz.wrap) of the model. (A model whose quantized kernels trained "
                "float deltas keeps them in its delta file, not in a .keras file: ff.load_delta applies them.)",
                FreezeWarning,
                stacklevel=4,
            )
            return True
    elif not opt.built:  # a custom loop loading before its first step
        opt.build(frz._build_variables())
    if frz is not None:
        frz._adopt_checkpoint(masks(rec, store), rec["plan"], rec["step"], rec["gradients"])
        born_as_saved(state, rec, store)
    keys = positional_keys(store)
    stored = opt._stored_variables()
    if len(keys) != len(stored):
        raise PlanError(
            f"the checkpoint holds {len(keys)} optimizer variables for its plan, but the optimizer has "
            f"{len(stored)} once that plan is in force: it was written by another optimizer "
            f"(this one wraps {type(opt.inner_optimizer).__name__}). Resume with the optimizer the run started with."
        )
    for i, variable in enumerate(stored):
        variable.assign(store[str(i)])
    if frz is not None:
        frz._rebase()
    return True


def born_as_saved(state, rec: dict, store) -> None:
    """Give each enforcer of ``state`` the release-step variable the checkpoint holds for it, in the saved order.

    They are the last of the optimizer's own variables, made as the releases
    came; the values load by position with the rest.
    """
    saved = sorted(
        (slots["born"], path, slots.get("u_product")) for path, slots in rec["slots"].items() if "born" in slots
    )
    if saved and state.count_kind == "none":
        warnings.warn(
            f"the checkpoint counts released elements' steps from their release ({len(saved)} variables), but this "
            "optimizer keeps Keras' global count (step_count='global'); the counts load and are not used. "
            "Wrap with step_count='release' to resume as the checkpoint was written.",
            FreezeWarning,
            stacklevel=5,
        )
    state.load_ages(saved, store)


def load_plain(opt, store) -> None:
    """Keras' own loading, by position, of a checkpoint without a record (see the module's docstring)."""
    stored = opt._stored_variables()
    keys = positional_keys(store)
    if len(keys) != len(stored):
        warnings.warn(
            f"Skipping variable loading for optimizer {opt.name!r}, because it has {len(stored)} variables "
            f"whereas the saved optimizer has {len(keys)} variables.",
            stacklevel=4,
        )
        return
    for i, variable in enumerate(stored):
        variable.assign(store[str(i)])


def stored(opt) -> list:
    """The variables ``opt`` saves: its own and the inner optimizer's, with each stand-in where ``compact``'s vector is.

    A sliced kernel's ``compact`` vector is the stand-in its layer hands the
    gradient to (a model variable), not a variable of the optimizer; it is
    saved in the place the optimizer's own vector has, right after its
    index, so a run that slices a kernel and one that does not write the
    same checkpoint.
    """
    after = {id(e.index): e.standin for e in opt._enforcers if e.standin is not None and e.kind == Kind.COMPACT}
    out = []
    for w in opt.variables:
        out.append(w)
        if id(w) in after:
            out.append(after[id(w)])
    return out


@contextlib.contextmanager
def _as_saved(opt):
    """``opt``'s variables as saved: without the gradient norms, whether FreezeBoard tracks them or not."""
    tracking = opt._record_norms(False)
    try:
        yield
    finally:
        opt._record_norms(tracking)


def save(opt, store) -> None:
    """Write ``opt``'s variables by position (:func:`stored`) and, once it is built, the record."""
    with _as_saved(opt):
        variables = stored(opt)
        for i, w in enumerate(variables):
            store[str(i)] = w.numpy()
        if opt.built and opt._layout is not None:
            write(store, record(opt, variables))


def load_into(opt, state, store, frz) -> None:
    """Load ``store`` into ``opt`` (its enforcement ``state``, bound to ``frz`` or None): by its record, else by position."""
    with _as_saved(opt):
        if load(opt, state, store, frz):
            state.values_loaded()  # the record holds the masks; an optimizer saved unbuilt or by Keras has none
        else:
            load_plain(opt, store)
