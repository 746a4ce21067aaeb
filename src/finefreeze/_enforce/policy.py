"""What inner optimizers can do, and the policy that picks a kind per partially frozen variable.

The table of capabilities (:data:`ELEMENTWISE`: whose update is elementwise,
so ``compact`` changes no maths; :func:`inexact_reasons`: why gradient
masking alone would drift; :func:`zero_gradient_hazards`: where exactly-zero
gradients turn into NaN) and the policy (:func:`choose_kind`: ``auto`` picks
``compact`` for small trainable fractions of elementwise optimizers, else
``restore``; :data:`AUTO_COMPACT_AT_MOST`). ``auto`` changes cost, never maths.

Example:
    >>> import keras
    >>> from finefreeze._enforce.policy import compact_refusal
    >>> compact_refusal(keras.optimizers.Adam()) is None, compact_refusal(keras.optimizers.Lamb())
    (True, 'Lamb: its trust ratio is a per-tensor norm')
"""

from __future__ import annotations

import warnings

import numpy as np

from finefreeze._backends.chosen import has_int64, lookups_are_sparse
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._keras.optimizers import sub_optimizers
from finefreeze._kinds import Kind

__all__ = [
    "warn_inexact_mask",
    "AUTO_COMPACT_AT_MOST",
    "ELEMENTWISE",
    "choose_kind",
    "compact_refusal",
    "family",
    "index_dtype",
    "inexact_reasons",
    "is_elementwise",
    "refuse_nan",
    "sparse_gradients",
    "zero_gradient_hazards",
]


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


def is_elementwise(opt) -> bool:
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
    if opt is None or is_elementwise(opt):
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


def family(opt) -> list:
    """``opt`` and the sub-optimizers a ``MultiOptimizer`` holds."""
    return [opt, *sub_optimizers(opt)]


def sparse_gradients(owner) -> bool:
    """Whether the variable's gradient arrives sparse (TensorFlow embeddings: ``IndexedSlices``).

    Keras optimizers apply such a gradient on their sparse path; ``compact``
    hands its vector a sparse gradient of the same entries
    (:func:`finefreeze._backends.variables.take_trainable`), so the update
    is the same bit for bit, and ``auto`` compacts such variables at any
    trainable fraction: state and step for the trained elements only.
    """
    return lookups_are_sparse(owner)


def _no_int64(size: int) -> bool:
    """Whether flat indices into ``size`` elements need int64 and the backend has no int64 (JAX without x64)."""
    return index_dtype(size) == "int64" and not has_int64()


def choose_kind(
    strategy: str, n_trainable: int, size: int, variable, inner, sparse: bool = False, path: str = ""
) -> str:
    """The concrete strategy of one partially frozen variable.

    Raises:
        PlanError: explicit ``compact`` of a variable of 2**31 elements or more on JAX without x64.
    """
    if strategy == "auto":
        # a sparse gradient reaches compact's vector sparse (take_trainable): its step costs the
        # batch's rows and the trained elements, restore's the whole table, at any fraction
        small = sparse or n_trainable <= AUTO_COMPACT_AT_MOST * size
        allowed = compact_refusal(inner) is None and not _constrained(variable)
        return Kind.COMPACT if small and allowed and not _no_int64(size) else Kind.RESTORE
    if strategy == Kind.COMPACT and _no_int64(size):
        raise PlanError(
            f"strategy='compact' on {path!r} ({size} elements) needs int64 flat indices, and JAX runs "
            "without 64-bit integers: enable them before building the model "
            "(jax.config.update('jax_enable_x64', True)) or use strategy='restore'."
        )
    if strategy == Kind.COMPACT and _constrained(variable):
        return Kind.RESTORE  # a constraint acts on the whole variable
    return strategy


def _constrained(variable) -> bool:
    return getattr(variable, "constraint", None) is not None


def warn_inexact_mask(inner, layout) -> bool:
    """Warn (``FreezeWarning``) when ``layout`` uses ``mask`` with an optimizer it is not exact with; return whether."""
    reasons = inexact_reasons(inner) if any(e.kind == Kind.MASK for e in layout) else []
    if reasons:
        warnings.warn(
            f"strategy 'mask' (gradient masking alone) is not exact with {type(inner).__name__}: "
            f"{'; '.join(reasons)}. Frozen elements will drift; use strategy 'restore' or 'compact'.",
            FreezeWarning,
            stacklevel=5,
        )
    return bool(reasons)


def inexact_reasons(opt) -> list[str]:
    """Why gradient masking alone would move frozen elements under ``opt``."""
    reasons = []
    if getattr(opt, "weight_decay", None):
        reasons.append(f"weight_decay={opt.weight_decay}")
    if getattr(opt, "use_ema", False):
        reasons.append("use_ema=True")
    name = type(opt).__name__
    if name in ("SGD", "RMSprop"):
        if getattr(opt, "momentum", 0.0):
            reasons.append(f"momentum={opt.momentum}")
    elif name not in ("Adagrad", "Adadelta"):
        reasons.append(f"{name} keeps moving elements whose gradient is 0 (momentum or its own state)")
    return reasons


def zero_gradient_hazards(inner, layout) -> list[str]:
    """Partially frozen variables whose exactly-zero gradients the inner optimizer turns into NaN.

    Keras' Adafactor estimates an element's second moment as the product of
    its row's (normalised by the mean row) and its column's, over the last
    two axes. An element whose row and column both hold only frozen elements,
    in a matrix that is not frozen whole, gets a product that underflows to
    0, its update is 0/0, and the update clipping spreads the NaN over the
    whole variable (in plain Keras too, with such gradients).
    """
    out = []
    for o in family(inner):
        if type(o).__name__ != "Adafactor":
            continue
        for e in layout:
            if e.kind not in (Kind.RESTORE, Kind.MASK) or e.mask is None or len(e.shape) < 2:
                continue
            frozen = e.mask.dense()
            rows, cols = frozen.all(axis=-1), frozen.all(axis=-2)  # (..., R) and (..., C)
            # a slice of the leading axes frozen whole is harmless: its row moments normalise to 1
            whole = frozen.all(axis=(-2, -1))[..., None, None]
            if (rows[..., :, None] & cols[..., None, :] & ~whole).any():
                out.append(f"{e.path!r} (shape {e.shape})")
    return out


def refuse_nan(inner, layout) -> None:
    """Refuse a layout the inner optimizer would turn into NaN.

    Raises:
        PlanError: Keras' Adafactor with a partially frozen matrix that has a
            fully frozen row and a fully frozen column.
    """
    hazards = zero_gradient_hazards(inner, layout)
    if hazards:
        raise PlanError(
            f"Adafactor would turn training into NaN with {', '.join(hazards)}: these variables have a row "
            "and a column (over their last two axes) whose elements are all frozen, in a matrix that is not "
            "frozen whole; Keras' Adafactor factors second moments over rows and columns, the moment of "
            "such an element underflows to 0 and its update is 0/0 (plain Keras does the same with such "
            "gradients). Freeze those variables (or those matrices) whole, train at least one element in "
            "every row or column, or use another optimizer (Adam, AdamW, Lion)."
        )
