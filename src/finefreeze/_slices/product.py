"""The gradient of a kernel's trained elements, in their own shape, handed to a variable of their own.

A layer computes ``y = op(x, kernel)`` (a matmul, an einsum, a convolution,
an embedding's lookup), linear in the kernel. When only some elements of
the kernel train, :func:`sliced_product` computes the same ``y`` and the
same input gradient as ``op`` does, and hands the gradient of the trained
elements to a *stand-in*: a flat variable of those elements alone (in
sorted flat order, ``compact``'s order), which the optimizer updates and
writes back into the kernel in place. The kernel itself gets no gradient:
no kernel-shaped gradient, padded block or scatter exists in the step.

How the trained elements' gradient is computed:

- a *block* of the kernel (some indices along some of its axes: rows,
  columns, output or input channels, heads) holding every trained element
  (:class:`Taken`): the backend's own vector-Jacobian product of ``op`` on
  the block (``op(x[..., rows], kernel[rows][:, cols])`` at
  ``dy[..., cols]``), a product the size of the block; the trained
  elements are then taken from it (all of it, in its order, when they are
  the block);
- rows of a table looked up by ids (new tokens): ``dy`` summed per id over
  those rows (JAX, PyTorch); TensorFlow hands the stand-in the batch's
  entries as ``IndexedSlices`` over its elements, so Keras' sparse update
  is the one it gives a table's rows;
- scattered elements (:class:`Sampled`): ``sum_n x[n, i] * dy[n, j]`` for
  each trained element (the *sampled product*: gathered in chunks of a
  bounded size; PyTorch's ``sampled_addmm`` at their pattern), for
  ``Dense`` and ``EinsumDense`` kernels and a tied table's reverse
  projection.

How each backend takes the gradient apart: the forward is
``op(x, stop_gradient(kernel))`` (the very op the layer runs, so ``y`` and
the input gradient are the layer's own), passed through a *tap* whose
forward is the identity and whose backward hands ``dy`` on unchanged and
gives the stand-in its gradient: ``tf.custom_gradient`` (TensorFlow),
``jax.custom_vjp`` (JAX), a ``torch.autograd.Function`` (PyTorch). Inside
:func:`full_gradients` (``select`` scores every element) layers compute
their whole weight gradient instead.

The trained elements' gradients are sums over the same products as the full
weight gradient's, but the backend may sum a smaller product in another
order: they equal the dense path's up to float rounding (the bound measured
is in ``docs/guarantees.md``). Half-precision inputs of the sampled product
are summed in float32, as a matmul sums them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
from keras import ops

from finefreeze._backends.chosen import chosen
from finefreeze._backends.variables import is_sparse

__all__ = [
    "Taken",
    "flat_ids",
    "full_gradients",
    "looked_up",
    "lookup",
    "sliced_product",
    "slicing",
    "spread",
    "wrapped",
]

_full = [0]  # inside full_gradients(): every layer computes its whole weight gradient


@contextlib.contextmanager
def full_gradients() -> Iterator[None]:
    """Steps traced inside compute every kernel's whole weight gradient (``select`` scores frozen elements too)."""
    _full[0] += 1
    try:
        yield
    finally:
        _full[0] -= 1


def slicing() -> bool:
    """Whether a sliced layer computes its trained elements' gradient only (False inside :func:`full_gradients`)."""
    return _full[0] == 0


def _positions(frozen: np.ndarray | None, index) -> np.ndarray | None:
    """The trained elements' places in the flattened block (C order); None when they are the whole block.

    Every trained element lies in the block (it is the smallest that holds them).
    """
    if frozen is None:
        return None
    frozen = np.asarray(frozen, dtype=bool)
    sub = frozen[np.ix_(*(np.arange(n) if i is None else i for n, i in zip(frozen.shape, index)))]
    if not sub.any():
        return None
    return np.flatnonzero(~sub).astype(np.int32)


def _row_of(rows: int, index: np.ndarray) -> np.ndarray:
    """Each of a table's ``rows`` rows' place in the block of rows ``index`` (``len(index)`` for rows outside it)."""
    out = np.full(rows, len(index), np.int32)
    out[index] = np.arange(len(index), dtype=np.int32)
    return out


class Taken:
    """A block of a kernel holding its trained elements: its indices per axis, and the axes of ``x`` and ``y``.

    A block's indices along an axis that form a range are taken with a
    slice, other index lists with a gather.

    Args:
        shape: the kernel's shape.
        index: per kernel axis, the sorted indices of the block along it, or None for the whole axis.
        x_axis: per kernel axis, the axis of ``x`` it is contracted with, or None.
        y_axis: per kernel axis, the axis of ``y`` it becomes, or None.
        frozen: the kernel's frozen mask (True = frozen); None: every element of the block trains.
        transposed: the layer multiplies by the kernel's transpose (a tied table's reverse
            projection): ``shape``, ``index`` and the axes are the transpose's, the stand-in
            follows the table's order.
    """

    def __init__(self, shape, index, x_axis, y_axis, frozen=None, transposed: bool = False):
        self.shape = tuple(int(d) for d in shape)
        self.index = tuple(None if i is None else np.asarray(i, dtype=np.int32) for i in index)
        self.x_axis, self.y_axis = tuple(x_axis), tuple(y_axis)
        self.transposed = transposed
        self.block_shape = tuple(n if i is None else len(i) for n, i in zip(self.shape, self.index))
        table_index = self.index[::-1] if transposed else self.index
        table_frozen = None if frozen is None else np.asarray(frozen, dtype=bool)
        #: the trained elements' places in the flattened block (table order); None: all of it
        self.positions = _positions(table_frozen, table_index)
        self._positions = None if self.positions is None else chosen().index_constant(self.positions)
        # per sliced axis: (start, stop) of a range, or the index list (taken by a gather)
        self.places = []
        for idx in self.index:
            if idx is None:
                self.places.append(None)
            elif len(idx) and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
                self.places.append((int(idx[0]), int(idx[0]) + len(idx)))
            else:
                self.places.append(idx)
        self._grads: dict = {}
        #: with a list of rows: each row's place in the block (``len(block)`` outside it), for a table's lookups
        self._row_of = None
        if self.index and self.places[0] is not None and not isinstance(self.places[0], tuple):
            self._row_of = chosen().index_constant(_row_of(self.shape[0], self.index[0]))

    @staticmethod
    def _take(t, axis: int, idx, place):
        axis = axis % len(t.shape)
        if isinstance(place, tuple):
            return t[(slice(None),) * axis + (slice(*place),)]
        return ops.take(t, idx, axis=axis)

    def take_x(self, x):
        for i, idx in enumerate(self.index):
            if idx is not None and self.x_axis[i] is not None:
                x = self._take(x, self.x_axis[i], idx, self.places[i])
        return x

    def take_y(self, dy):
        for i, idx in enumerate(self.index):
            if idx is not None and self.y_axis[i] is not None:
                dy = self._take(dy, self.y_axis[i], idx, self.places[i])
        return dy

    def take_kernel(self, k):
        for i, idx in enumerate(self.index):
            if idx is not None:
                k = self._take(k, i, idx, self.places[i])
        return k

    def trained(self, block):
        """The stand-in's gradient from the block's: flat, in the table's (or kernel's) order, trained elements only."""
        if self.transposed:
            block = ops.transpose(block)
        flat = ops.reshape(block, (-1,))
        return flat if self._positions is None else ops.take(flat, self._positions, axis=0)

    def gradient_of(self, op: Callable) -> Callable:
        """``(x, dy, kernel) -> the stand-in's gradient``, one function per ``op`` (compilers guard on it)."""
        if op not in self._grads:

            def weight_gradient(x, dy, k):
                return self.trained(chosen().vjp(op, self.take_x(x), self.take_kernel(k), self.take_y(dy)))

            def rows_gradient(ids, dy, table):
                return self.rows_of(ids, dy)

            self._grads[op] = rows_gradient if op is lookup else weight_gradient
        return self._grads[op]

    def _segments(self, ids):
        """Each id's row in the block (``len(block)`` for ids outside it), ids counted from the end as Keras takes them."""
        n = self.block_shape[0]
        ids = flat_ids(ids, self.shape[0])
        place = self.places[0]  # a table's rows: a range or an index list, never the whole axis
        if isinstance(place, tuple):
            pos = ops.subtract(ids, place[0])
            inside = ops.logical_and(ops.greater_equal(pos, 0), ops.less(pos, n))
            return ops.where(inside, pos, n)
        return ops.take(ops.convert_to_tensor(self._row_of), ids, axis=0)

    def rows_of(self, ids, dy):
        """The stand-in's gradient of a table looked up at ``ids``: ``dy`` summed per row of the block.

        On TensorFlow: the batch's entries in the block as ``IndexedSlices``
        over the stand-in's elements, duplicates kept, as Keras' own
        gradient of a lookup gives them for a table (frozen elements of a
        row are ``0.0`` at position 0, which adds nothing); elsewhere a dense
        vector.
        """
        segment = self._segments(ids)
        return chosen().rows_gradient(self, segment, ops.reshape(dy, (-1, self.shape[1])))


def flat_ids(ids, rows: int):
    """A lookup's ids as one int32 vector, counted from the start (:func:`wrapped`)."""
    return wrapped(ops.reshape(ops.cast(ids, "int32"), (-1,)), rows)


def wrapped(ids, rows: int):
    """Negative ids counted from the end, as ``keras.ops.take`` counts them (``-1``: the last row)."""
    return ops.where(ops.less(ids, 0), ops.add(ids, ops.cast(rows, ids.dtype)), ids)


def lookup(ids, table):
    """``Embedding``'s product: the rows of ``table`` at ``ids`` (its gradient is the looked-up rows' own)."""
    return ops.take(table, ids, axis=0)


def read_rows(table, ids, *, constant: bool = False):
    """The rows of ``table`` (a Keras variable) at ``ids``, as Keras' ``Embedding`` reads them.

    A dense read of the table (it shares the table's buffer) and a gather:
    its gradient is Keras' own (``IndexedSlices`` of the batch's rows on
    TensorFlow). A sparse read (``ResourceGather``) would switch the table
    to copying itself at every dense read, a tied table's reverse
    projection included. ``constant``: no gradient reaches the table.
    """
    value = ops.convert_to_tensor(table)
    return lookup(wrapped(ids, int(table.shape[0])), ops.stop_gradient(value) if constant else value)


def looked_up(table, ids, taken, standin, index=None):
    """``Embedding``'s lookup of ``ids`` in ``table`` whose trained rows' (or elements') gradient goes to ``standin``.

    The table is read by rows (:func:`read_rows`), never whole. ``index``:
    scattered elements' flat indices (``TableElements``), read in the step.
    """
    read = lambda i, _: read_rows(table, i, constant=True)  # noqa: E731
    return sliced_product(read, ids, ops.zeros(()), taken, standin, lookup, index=index)


def sliced_product(op: Callable, x, kernel, taken, standin, gradient_op: Callable | None = None, index=None):
    """``op(x, kernel)``, the trained elements' gradient handed to ``standin`` and none to the kernel.

    Args:
        op: ``(x, kernel) -> y``, linear in the kernel (the layer's own product).
        x: the layer's input.
        kernel: the kernel's value as the layer reads it (autocast included).
        taken: the trained elements (:class:`Taken`, or a ``Sampled`` product).
        standin: the stand-in's value (the variable of the trained elements, read in the step).
        gradient_op: the product the stand-in's gradient is taken of (default ``op``).
        index: a sampled product's flat indices of the trained elements (read in the step).

    Returns:
        ``y``, equal to ``op(x, kernel)`` bit for bit, with its input gradient the same too.
    """
    y = op(x, ops.stop_gradient(kernel))
    weight_gradient = taken.gradient_of(gradient_op or op)
    # what the backward needs beside x and dy: the kernel (a block's product), or a sampled product's indices
    residual = ops.stop_gradient(kernel) if index is None else index
    # x reaches the tap without a gradient path: its gradient is the layer's own, from op alone
    return chosen().tap(y, ops.stop_gradient(x), residual, standin, weight_gradient)


def spread(standin_grad, trained: np.ndarray, shape):
    """A stand-in's gradient as its kernel's (zero elsewhere), for ``restore`` and ``mask``, which hold dense state."""
    size = int(np.prod(shape, dtype=np.int64))
    if is_sparse(standin_grad):  # TensorFlow's rows: the table's IndexedSlices, as Keras' own gradient has them
        return chosen().spread_sparse(standin_grad, trained, shape)
    where = ops.expand_dims(ops.convert_to_tensor(trained.astype(np.int32 if size < 2**31 else np.int64)), 1)
    return ops.reshape(ops.scatter(where, standin_grad, (size,)), shape)
