"""The axis each slice word means: ``rows``, ``columns``, ``heads``, for plans and for ``select(structure=...)``.

One meaning per word, wherever it is written (a rule's ``rows=`` /
``columns=`` / ``heads=``, ``select(..., structure=...)``):

- ``rows``: the first axis: a ``Dense`` kernel's inputs, an ``Embedding``
  table's tokens, an ``EinsumDense`` kernel's first axis (the model
  dimension of a ``(model, heads, head_dim)`` q/k/v kernel; the heads of
  a ``(heads, model, head_dim)`` one and of a ``(heads, head_dim, model)``
  attention output);
- ``columns`` (and ``channels``): the last axis: a ``Dense`` kernel's
  output units, a convolution's output channels, an ``Embedding`` table's
  features, a q/k/v kernel's ``head_dim`` features, an attention output
  kernel's model dimension;
- ``heads``: the heads axis of a three-axis ``EinsumDense`` kernel (an
  attention projection): the axis of the kernel that the layer's output
  keeps when the model dimension is contracted, i.e. axis 1 of
  ``(model, heads, head_dim)`` kernels and axis 0 of ``(heads, model,
  head_dim)`` and ``(heads, head_dim, model)`` kernels.

A one-axis variable (a bias, a norm's scale) has one axis for ``rows`` and
``columns`` alike.

Example:
    >>> import numpy as np
    >>> fraction_mask("columns", 0.25, (2, 8), None, "rule 1").astype(int).tolist()
    [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
"""

from __future__ import annotations

import numpy as np

from finefreeze._errors import PlanError

__all__ = ["SLICE_WORDS", "einsum_axes", "fraction_mask", "slice_axis", "slice_count", "word_axis"]

#: the slice words a rule takes as keywords (``rows=0.01``)
SLICE_WORDS = ("rows", "columns", "heads")


def einsum_axes(equation: str, rank: int):
    """Per kernel axis of an ``EinsumDense`` equation: (x axis, y axis), each None unless the letter is only there."""
    try:
        ins, y = equation.replace(" ", "").split("->")
        x, k = ins.split(",")
    except ValueError:
        return None
    if "..." in k or len(k) != rank:
        return None

    def positions(spec):
        if "..." not in spec:
            return {c: i for i, c in enumerate(spec)}
        pre, post = spec.split("...")
        return {**{c: i for i, c in enumerate(pre)}, **{c: i - len(post) for i, c in enumerate(post)}}

    px, py = positions(x), positions(y)
    x_axis = tuple(px[c] if c in px and c not in py else None for c in k)
    y_axis = tuple(py[c] if c in py and c not in px else None for c in k)
    return x_axis, y_axis


def heads_axis(shape: tuple, owner) -> int | None:
    """The heads axis of a three-axis ``EinsumDense`` kernel, or None where there is none."""
    if len(shape) != 3 or not isinstance(getattr(owner, "equation", None), str):
        return None
    axes = einsum_axes(owner.equation, 3)
    if axes is None:
        return None
    contracted = [i for i, a in enumerate(axes[0]) if a is not None]
    return 1 if contracted == [0] else 0


def slice_axis(structure: str, shape: tuple, owner=None) -> int | None:
    """The axis whose slices ``structure`` takes of a variable of ``shape`` (None: single elements).

    ``select``'s lenient form: ``heads`` of a variable with no heads axis is its last axis.
    """
    if structure == "elements" or len(shape) < 1:
        return None
    if len(shape) < 2:
        return 0  # each element is a slice of its own
    if structure == "rows":
        return 0
    if structure == "heads":
        axis = heads_axis(shape, owner)
        if axis is not None:
            return axis
    return len(shape) - 1


def word_axis(word: str, shape: tuple, owner, where: str) -> int:
    """The axis ``word`` means for a variable of ``shape`` owned by ``owner`` (a plan's strict form).

    Raises:
        PlanError: a scalar, or ``heads`` of a variable with no heads axis.
    """
    if not shape:
        raise PlanError(f"{where}: {word}= needs a variable with axes; this one is a scalar. Drop {word}= for it.")
    if word == "heads":
        axis = heads_axis(shape, owner)
        if axis is None:
            raise PlanError(
                f"{where}: heads= applies to the three-axis kernels of EinsumDense attention projections only; "
                f"this variable of {type(owner).__name__ if owner is not None else 'no layer'} has no heads axis. "
                "Narrow the selector (e.g. '**/attention/**/kernel'), or use rows= or columns=."
            )
        return axis
    return 0 if word == "rows" or len(shape) == 1 else len(shape) - 1


def slice_count(fraction: float, n: int) -> int:
    """How many of ``n`` slices a fraction takes: rounded half up, at least 1 (as ``select``'s budget)."""
    return max(1, min(n, int(np.floor(fraction * n + 0.5))))


def fraction_mask(word: str, fraction: float, shape: tuple, owner, where: str) -> np.ndarray:
    """Bool mask of the first ``fraction`` of the ``word`` slices of a variable of ``shape``.

    Raises:
        PlanError: as :func:`word_axis`.
    """
    axis = word_axis(word, shape, owner, where)
    keep = np.zeros(shape[axis], bool)
    keep[: slice_count(fraction, shape[axis])] = True
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return np.broadcast_to(keep.reshape(view), shape)
