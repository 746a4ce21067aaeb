"""Whole slices for ``select(..., structure=...)``: rows, columns, channels or heads chosen by their mean score.

With ``structure="elements"`` (the default) ``select`` takes the top
elements. Otherwise each candidate variable is cut into slices along one
axis (:func:`slice_axis`) and whole slices are taken, best first, while
they fit in the budget (a slice that does not fit is passed over for the
next that does). A slice's worth is the mean score of its candidate
elements, so a long slice does not win by its length alone; ties go to the
earlier variable, then the lower index. Variables of one axis (biases,
norm scales) are their own slices of one element. The result is a plan of
slices, which a ``Dense``, ``EinsumDense`` or ``Conv`` kernel trains (with
``Freezer(..., gradients="sliced")``) at the
slice's own cost (the weight gradient and optimizer state of the slice
only, docs/guarantees.md).

The words mean what they mean in a rule's ``rows=`` / ``columns=`` /
``heads=`` (:mod:`finefreeze._resolve.axes`); ``"channels"`` is
``"columns"``, and ``"heads"`` of a variable with no heads axis is its
last axis.

Example:
    >>> import numpy as np
    >>> from finefreeze._select.structure import choose_slices
    >>> s = np.array([[1.0, 9.0, 0.0], [1.0, 7.0, 0.0]])
    >>> choose_slices([s], [np.ones((2, 3), bool)], [1], 2)[0].astype(int).tolist()
    [[0, 1, 0], [0, 1, 0]]
"""

from __future__ import annotations

import numpy as np

from finefreeze._resolve.axes import slice_axis

__all__ = ["STRUCTURES", "choose_slices", "slice_axis"]

STRUCTURES = ("elements", "rows", "columns", "channels", "heads")


def choose_slices(scores: list[np.ndarray], allowed: list[np.ndarray], axes: list[int | None], k: int) -> list:
    """Bool masks of whole slices (the allowed elements of each) with the best mean scores, at most ``k`` elements.

    ``axes[i]`` None cuts variable ``i`` into single elements. At least one
    slice is taken (the best), even when it alone is more than ``k``.
    """
    worth, size, where = [], [], []
    for i, (s, m, axis) in enumerate(zip(scores, allowed, axes)):
        s = np.asarray(s, np.float64)
        if axis is None:
            lines_s, lines_m = s.reshape(-1, 1), m.reshape(-1, 1)
        else:
            lines_s = np.moveaxis(s, axis, 0).reshape(s.shape[axis], -1)
            lines_m = np.moveaxis(m, axis, 0).reshape(m.shape[axis], -1)
        n = lines_m.sum(axis=1)
        total = np.where(lines_m, lines_s, 0.0).sum(axis=1)
        keep = np.flatnonzero(n > 0)
        worth.append(total[keep] / n[keep])
        size.append(n[keep])
        where.append(np.stack([np.full(len(keep), i), keep], axis=1))
    worth, size, where = np.concatenate(worth), np.concatenate(size), np.concatenate(where)
    order = np.lexsort((where[:, 1], where[:, 0], -worth))  # best first; ties: earlier variable, lower index
    chosen = [np.zeros(m.shape, bool) for m in allowed]
    used = 0
    for j in order:
        if used + size[j] > k and used > 0:
            continue
        i, line = where[j]
        if axes[i] is None:
            chosen[i].reshape(-1)[line] = allowed[i].reshape(-1)[line]
        else:
            view = np.moveaxis(chosen[i], axes[i], 0)  # a view: writes land in chosen[i]
            view[line] = np.moveaxis(allowed[i], axes[i], 0)[line]
        used += int(size[j])
        if used >= k:
            break
    return chosen
