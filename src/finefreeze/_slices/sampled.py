"""The sampled product: the gradient of a kernel's scattered trained elements, one dot product each.

A kernel of which a few elements train, scattered (a ``select`` at a small
budget, ``mask=`` of random elements), lies in no small block. Its trained
elements' gradient is ``sum_n x[n, a] * dy[n, b]`` for each of them: ``a``
the column of the layer's input and ``b`` the column of its output
gradient that the element joins. :class:`Sampled` computes those dot
products only (the backend's ``sampled_dots``: the columns gathered in
chunks of a bounded size, or PyTorch's sampled sparse product), for
``Dense`` and ``EinsumDense`` kernels;
:func:`finefreeze._slices.product.sliced_product` hands them to the
kernel's stand-in. It also reads a variable through its transpose: a tied
table's reverse projection. :class:`TableElements` gives scattered
elements of an embedding's table the lookup's gradient at them alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from keras import ops

from finefreeze._backends.chosen import chosen
from finefreeze._slices.product import flat_ids

__all__ = ["INDEX_BLOCK", "SAMPLED_CHUNK", "Sampled", "TableElements", "padded_index"]

#: the sampled product gathers at most this many values of ``x`` (and of ``dy``) at a time
SAMPLED_CHUNK = 1 << 21
#: the index the product reads is as long as a multiple of this (or a power of two below it): see :func:`padded_index`
INDEX_BLOCK = 1024


def padded_index(trained: np.ndarray) -> np.ndarray:
    """The flat indices ``trained``, the last one repeated to a length that chunks of a power of two divide.

    The product's chunks are then of equal length without padding in the
    step (``gathered.gathered_dots``): padded in the step, XLA on a CPU
    kept about 3 MB of compiled code more per kernel (20 kernels of 1 %:
    90 MB against 27). The repeats' sums are computed and dropped: at most
    ``INDEX_BLOCK - 1`` more dot products per kernel (at most twice as
    many below ``INDEX_BLOCK``).

    Args:
        trained: the sorted flat indices of the trained elements.

    Returns:
        ``trained`` extended to a multiple of :data:`INDEX_BLOCK` (past it)
        or to a power of two (up to it), in ``trained``'s dtype.
    """
    n = int(trained.size)
    if n == 0:
        return trained
    size = -(-n // INDEX_BLOCK) * INDEX_BLOCK if n > INDEX_BLOCK else 1 << (n - 1).bit_length()
    return np.concatenate([trained, np.repeat(trained[-1:], size - n)])


class Sampled:
    """Scattered trained elements of a kernel: their gradient ``sum_n x[n, a] * dy[n, b]`` only (a sampled product).

    ``x`` is laid out as ``(N, A)``: its axes that are not the kernel's
    (batch, sequence) first, flattened to ``N``, then the kernel's axes it
    is contracted with, in the kernel's order, flattened to ``A``; ``dy``
    likewise as ``(N, B)``. Each trained element is then a column ``a`` of
    ``x`` and a column ``b`` of ``dy``, and its gradient their dot product
    over ``N``. ``a`` and ``b`` are computed in the step from the elements'
    flat indices (a variable: indices compiled into the program as
    constants would cost the compiler gigabytes), held as
    :func:`padded_index` makes them. The backend computes the
    dot products (``sampled_dots``): the columns gathered for at most
    :data:`SAMPLED_CHUNK` values of each at a time (a map over chunks of
    elements, one chunk after another), or PyTorch's sampled sparse product
    at the elements' pattern; no temporary grows with the kernel.

    Args:
        x_spec, k_spec, y_spec: the einsum letters of ``x``, the kernel and
            ``y`` (``...`` allowed in ``x`` and ``y``, for the same leading axes).
        shape: the kernel's shape, as the product reads it.
        count: the number of trained elements.
        transposed: the product reads the transpose of the variable the
            indices are of (a tied table's reverse projection).
        reads: the index the product reads (:func:`padded_index` of the
            elements), known ahead: each chunk of elements then transposes
            only the columns of the sorted side it spans (:meth:`window`).
    """

    def __init__(
        self,
        x_spec: str,
        k_spec: str,
        y_spec: str,
        shape,
        count: int,
        transposed: bool = False,
        reads: np.ndarray | None = None,
    ):
        self.x_spec, self.k_spec, self.y_spec = x_spec, k_spec, y_spec
        self.shape = tuple(int(d) for d in shape)
        self.count = int(count)
        self.transposed = transposed
        self._reads = reads
        self._windows: dict[int, int | None] = {}
        self.dims = dict(zip(k_spec, self.shape))
        self.xk = [c for c in k_spec if c in x_spec]
        self.yk = [c for c in k_spec if c in y_spec]
        self.width_x = math.prod(self.dims[c] for c in self.xk)
        self.width_y = math.prod(self.dims[c] for c in self.yk)
        #: how the elements' sorted flat indices order their ``(a, b)`` pairs: ``"a"`` (by ``a``, then ``b``),
        #: ``"b"`` (by ``b``, then ``a``) or None (the variable's axes interleave ``x``'s and ``dy``'s)
        letters = list(k_spec[::-1] if transposed else k_spec)  # the variable's axes
        self.order = "a" if letters == self.xk + self.yk else "b" if letters == self.yk + self.xk else None
        self._gradient = self.weight_gradient  # one function for every call (compilers guard on it)

    def gradient_of(self, op: Callable) -> Callable:
        """``(x, dy, flat indices) -> the stand-in's gradient`` (``op`` is the layer's product)."""
        return self._gradient

    def window(self, per: int) -> int | None:
        """The most columns of the sorted side (:attr:`order`) that a chunk of ``per`` elements spans.

        The chunks are the index's ``per`` elements at a time, the last one
        filled with repeats of the last element (as the product fills it);
        None when the elements are sorted by neither side or the index is
        not known ahead. The index of a stand-in never changes: other
        elements make another stand-in and another product.

        Example:
            >>> s = Sampled("...i", "ij", "...j", (100, 10), 4, reads=np.array([3, 7, 250, 251]))
            >>> s.order, s.window(2), s.window(4)
            ('a', 1, 26)
        """
        if self.order is None or self._reads is None or not len(self._reads):
            return None
        if per not in self._windows:
            flat = self._reads
            flat = np.concatenate([flat, np.repeat(flat[-1:], -len(flat) % per)]).reshape(-1, per)
            side = self.columns(flat)[0 if self.order == "a" else 1]
            self._windows[per] = int((side[:, -1] - side[:, 0]).max()) + 1
        return self._windows[per]

    def columns(self, flat):
        """``(a, b)``: each element's column of ``x`` and of ``dy``, from its flat index in the variable."""
        if self.order == "a":  # the variable's axes: x's, then dy's
            return flat // self.width_y, flat % self.width_y
        if self.order == "b":
            return flat % self.width_x, flat // self.width_x
        letters = self.k_spec[::-1] if self.transposed else self.k_spec  # the variable's axes
        strides, acc = {}, 1
        for c in reversed(letters):
            strides[c] = acc
            acc *= self.dims[c]
        part = {c: (flat // strides[c]) % self.dims[c] for c in letters}

        def ravel(cs):
            out = None
            for c in cs:
                out = part[c] if out is None else out * self.dims[c] + part[c]
            return ops.zeros_like(flat) if out is None else out

        return ravel(self.xk), ravel(self.yk)

    def permutation(self, rank: int, spec: str, kernel_letters: list[str]) -> list[int]:
        """The axes of a ``rank``-axis tensor with einsum letters ``spec`` in :meth:`_as_columns`' order."""
        if "..." in spec:
            pre, post = spec.split("...")
            free = [f"_{i}" for i in range(rank - len(pre) - len(post))]
            letters = list(pre) + free + list(post)
        else:
            letters = list(spec)
        batch = sorted((c for c in letters if c not in self.k_spec), key=self._batch_order)
        return [letters.index(c) for c in batch + kernel_letters]

    def _as_columns(self, t, spec: str, kernel_letters: list[str], width: int):
        """``t`` (with einsum letters ``spec``) as ``(N, width)``: its other axes first, then ``kernel_letters``."""
        perm = self.permutation(len(t.shape), spec, kernel_letters)
        if perm != list(range(len(perm))):
            t = ops.transpose(t, perm)
        return ops.reshape(t, (-1, width))

    def _batch_order(self, c: str):
        """The same order of the batch axes for ``x`` and ``y``: ``...``'s first, then ``y``'s letters."""
        if c.startswith("_"):
            return (0, int(c[1:]))
        y = self.y_spec.replace("...", "")
        return (1, y.index(c) if c in y else len(y))

    def weight_gradient(self, x, dy, flat):
        """The trained elements' gradient: ``flat`` is their :func:`padded_index`, the repeats' sums dropped."""
        x = self._as_columns(x, self.x_spec, self.xk, self.width_x)
        dy = self._as_columns(dy, self.y_spec, self.yk, self.width_y)
        flat = ops.convert_to_tensor(flat)
        # float32; the tap casts
        sums = chosen().sampled_dots(x, dy, flat, self.columns, self.order, SAMPLED_CHUNK, self.window)
        return sums if int(sums.shape[0]) == self.count else sums[: self.count]


class TableElements:
    """Scattered trained elements of an embedding's table: the lookup's gradient at those elements only.

    Element ``(r, c)``'s gradient is the sum of ``dy[n, c]`` over the
    entries ``n`` whose id is ``r`` (the backend's ``table_elements_gradient``:
    the batch's ``dy`` summed per distinct id, each element reading its own;
    on TensorFlow an entry per id and trained element of its row, as
    Keras' own ``IndexedSlices`` has them). Nothing of the table's shape is
    made: the dense gradient of a table is the table's size (its
    temporaries more), this one ``dy``'s size twice and the elements'.

    Args:
        shape: the table's shape ``(rows, width)``.
        trained: the sorted flat indices of the trained elements.

    Example:
        >>> import numpy as np
        >>> te = TableElements((40, 6), np.array([7, 8, 200]))
        >>> te.count, te.starts[:3].tolist(), te.widest
        (3, [0, 0, 2], 2)
    """

    def __init__(self, shape, trained: np.ndarray):
        self.shape = tuple(int(d) for d in shape)
        self.count = int(len(trained))
        rows, width = self.shape
        #: where each row's trained elements begin among them (``rows + 1`` values: the last is ``count``)
        self.starts = np.searchsorted(trained, np.arange(rows + 1, dtype=np.int64) * width).astype(np.int32)
        #: the most trained elements a row holds
        self.widest = int(np.diff(self.starts).max()) if rows else 0
        self._gradient = self.lookup_gradient  # one function for every call (compilers guard on it)

    def gradient_of(self, op: Callable) -> Callable:
        """``(ids, dy, flat indices) -> the stand-in's gradient`` (``op`` is the lookup)."""
        return self._gradient

    def lookup_gradient(self, ids, dy, flat):
        """The trained elements' gradient: ``flat`` is their :func:`padded_index` (the repeats' values dropped)."""
        ids = flat_ids(ids, self.shape[0])
        dy = ops.reshape(dy, (-1, self.shape[1]))
        return chosen().table_elements_gradient(self, ids, dy, ops.convert_to_tensor(flat))
