"""The weight gradient of a trained slice of a kernel, without the kernel's full weight gradient.

A layer computes ``y = op(x, kernel)`` (a matmul, an einsum, a
convolution), linear in the kernel. When only a block of the kernel trains
(some indices along some of its axes: rows, columns, output channels,
heads), :func:`sliced_product` computes the same ``y`` and the same input
gradient as ``op`` does, but the kernel's gradient is the weight gradient of
the block only, computed as the backend's own vector-Jacobian product of
``op`` on the block (``op(x[..., rows], kernel[rows][:, cols])`` at
``dy[..., cols]``): a product the size of the block instead of the kernel's.
Outside the block the kernel's gradient is exactly 0.

How each backend takes it apart:

- the forward is ``op(x, stop_gradient(kernel))`` (the very op the layer
  runs, so ``y`` and the input gradient are the layer's own), passed through
  a tap whose forward is the identity and whose backward hands ``dy`` on
  unchanged and gives the kernel the block's gradient;
- the tap is ``tf.custom_gradient`` (TensorFlow), ``jax.custom_vjp`` (JAX)
  or a ``torch.autograd.Function`` (PyTorch);
- the block's gradient is ``tf.GradientTape`` / ``jax.vjp`` /
  ``torch.autograd.grad`` of ``op`` on the block (in a traced step the
  block's forward is never computed: nothing reads it);
- the block is put into a kernel-shaped zero gradient with ``keras.ops``.

A ``Dense`` kernel's scattered trained elements (no block holds them) are
*sampled* (:class:`Sampled`): their gradient is ``sum(x[:, i] * dy[:, j])``
over the batch for each trained ``(i, j)``, two gathers and a sum instead of
the whole product, put into a kernel-shaped zero gradient.

An ``Embedding``'s table is looked up (:func:`looked_up`), not multiplied.
On JAX and PyTorch the gradient of its trained rows is the batch's ``dy``
summed per id (``segment_sum``) over those rows only; TensorFlow's own
gradient is already the batch's rows (``IndexedSlices``), and the table is
read sparsely so that it is never copied whole.

The trained elements' gradients are sums over the same products as the full
weight gradient's, but the backend may sum a smaller product in another
order: they equal the dense path's up to float rounding (the bound measured
is in ``docs/strategies.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import keras
import numpy as np
from keras import ops

from finefreeze._backends.questions import keras_backend

__all__ = ["Sampled", "Taken", "full_gradients", "looked_up", "lookup", "sliced_product", "slicing"]

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
    """Whether a sliced layer computes its slice's weight gradient only (False inside :func:`full_gradients`)."""
    return _full[0] == 0


class Taken:
    """Where a kernel's block sits: its indices per kernel axis, and the axes of ``x`` and ``y`` they run along.

    A block's indices along an axis that form a range are taken with a slice
    and put back with zero padding; other index lists with a gather, and put
    back with a gather from the block and one slice of zeros.

    Args:
        shape: the kernel's shape.
        index: per kernel axis, the sorted indices of the block along it, or None for the whole axis.
        x_axis: per kernel axis, the axis of ``x`` it is contracted with, or None.
        y_axis: per kernel axis, the axis of ``y`` it becomes, or None.
    """

    def __init__(self, shape, index, x_axis, y_axis):
        self.shape = tuple(int(d) for d in shape)
        self.index = tuple(None if i is None else np.asarray(i, dtype=np.int32) for i in index)
        self.x_axis, self.y_axis = tuple(x_axis), tuple(y_axis)
        self.block_shape = tuple(n if i is None else len(i) for n, i in zip(self.shape, self.index))
        self.sparse_rows = True  # PyTorch: an embedding's rows gradient as a sparse tensor
        # per sliced axis: (start, stop) of a range, or the position of every kernel index in the block
        # (len(index), a slice of zeros, where it is not in the block)
        self.places = []
        for n, idx in zip(self.shape, self.index):
            if idx is None:
                self.places.append(None)
            elif np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx))):
                self.places.append((int(idx[0]), int(idx[0]) + len(idx)))
            else:
                pos = np.full(n, len(idx), np.int32)
                pos[idx] = np.arange(len(idx), dtype=np.int32)
                self.places.append(pos)

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

    def gradient_of(self, op: Callable) -> Callable:
        """``(x, dy, kernel) -> the kernel-shaped gradient of the block``, one function per ``op`` (compilers guard on it)."""
        grads = self.__dict__.setdefault("_grads", {})
        if op not in grads:

            def weight_gradient(x, dy, k):
                return self.spread(_vjp(op, self.take_x(x), self.take_kernel(k), self.take_y(dy)))

            def rows_gradient(ids, dy, table):
                return self.spread_rows(self.rows_of(ids, dy))

            grads[op] = rows_gradient if op is lookup else weight_gradient
        return grads[op]

    def rows_of(self, ids, dy):
        """The gradient of the block's rows of a table looked up at ``ids``: ``dy`` summed per row, in the block's order.

        The ids outside the block land in one spare segment, dropped (PyTorch
        leaves their entries out before it sums).
        """
        n, width = self.block_shape[0], self.shape[1]
        ids = wrapped(ops.reshape(ops.cast(ids, "int32"), (-1,)), self.shape[0])
        place = self.places[0]
        if isinstance(place, tuple):
            pos = ops.subtract(ids, place[0])
            inside = ops.logical_and(ops.greater_equal(pos, 0), ops.less(pos, n))
            segment = ops.where(inside, pos, n)
        else:
            segment = ops.take(ops.convert_to_tensor(place), ids, axis=0)
        dy = ops.reshape(dy, (-1, width))
        if keras_backend() == "torch":  # Keras' segment_sum repeats every id across the row first
            import torch

            segment = segment.long()
            inside = torch.nonzero(segment < n).squeeze(1)  # the block's entries, in their order
            out = torch.zeros((n, width), dtype=dy.dtype, device=dy.device)
            return out.index_add_(0, segment.index_select(0, inside), dy.index_select(0, inside))
        return ops.segment_sum(dy, segment, num_segments=n + 1)[:n]

    def spread_rows(self, block):
        """The table's gradient from its block of rows: a sparse tensor of those rows on PyTorch, else dense.

        A dense one is zero outside the block; under ``jax.jit`` XLA folds
        the zeros and ``compact``'s slice of the rows away. Eager PyTorch
        would fill the whole table with zeros at every step: it gets a
        sparse COO gradient of the rows, as ``torch.nn.Embedding(sparse=True)``
        gives (``compact`` reads the rows back from it).
        """
        if keras_backend() != "torch" or not self.sparse_rows:
            return self.spread(block)
        import torch

        if torch.compiler.is_compiling():
            return self.spread(block)
        rows = torch.as_tensor(self.index[0], dtype=torch.int64, device=block.device)
        return torch.sparse_coo_tensor(rows[None], block, self.shape, is_coalesced=True, check_invariants=False)

    def spread(self, block):
        """The kernel-shaped gradient: ``block`` at its place, exact zeros elsewhere."""
        for axis, place in enumerate(self.places):
            if place is None:
                continue
            if isinstance(place, tuple):
                width = [(0, 0)] * len(self.shape)
                width[axis] = (place[0], self.shape[axis] - place[1])
                block = _pad(block, width)
            else:
                zero_shape = list(block.shape)
                zero_shape[axis] = 1
                padded = ops.concatenate([block, ops.zeros(zero_shape, block.dtype)], axis=axis)
                block = ops.take(padded, place, axis=axis)
        return block


class Sampled:
    """Scattered trained elements of a ``Dense`` kernel: the weight gradient at them only (a sampled product).

    Args:
        shape: the kernel's shape ``(n_in, n_out)``.
        rows: the row ``i`` of each trained element.
        cols: its column ``j``.
    """

    def __init__(self, shape, rows, cols):
        self.shape = tuple(int(d) for d in shape)
        self.rows = np.asarray(rows, dtype=np.int32)
        self.cols = np.asarray(cols, dtype=np.int32)
        self._gradient = self.weight_gradient  # one function for every call (compilers guard on it)

    def gradient_of(self, op: Callable) -> Callable:
        """``(x, dy, kernel) -> the kernel-shaped gradient at the trained elements`` (``op`` is the layer's matmul)."""
        return self._gradient

    def weight_gradient(self, x, dy, k):
        n_in, n_out = self.shape
        x, dy = ops.reshape(x, (-1, n_in)), ops.reshape(dy, (-1, n_out))
        dtype = keras.backend.standardize_dtype(k.dtype)
        wide = "float32" if dtype in ("float16", "bfloat16") else dtype  # half precision summed as matmul sums it
        if keras_backend() == "torch":  # Keras' take and scatter copy and check: PyTorch's own, on flat indices
            import torch

            if "_flat" not in self.__dict__:
                flat = self.rows.astype(np.int64) * n_out + self.cols
                self._flat = [torch.as_tensor(a.astype(np.int64)) for a in (self.rows, self.cols, flat)]
            rows, cols, flat = (a.to(x.device) for a in self._flat)
            a, b = (t.index_select(1, i).to(getattr(torch, wide)) for t, i in ((x, rows), (dy, cols)))
            out = torch.zeros(n_in * n_out, dtype=k.dtype, device=x.device)
            out[flat] = (a * b).sum(0).to(k.dtype)
            return out.view(n_in, n_out)
        # gathered as rows of the transposed arrays: one contiguous copy per element, not a strided one
        a = ops.cast(ops.take(ops.transpose(x), ops.convert_to_tensor(self.rows), axis=0), wide)
        b = ops.cast(ops.take(ops.transpose(dy), ops.convert_to_tensor(self.cols), axis=0), wide)
        values = ops.cast(ops.sum(a * b, axis=1), dtype)
        return ops.scatter(ops.convert_to_tensor(np.stack([self.rows, self.cols], axis=1)), values, self.shape)


def _pad(t, width):
    """``t`` padded with zeros by ``width`` (``(before, after)`` per axis).

    PyTorch's own pad: ``keras.ops.pad`` makes a named Keras operation at
    every call, and the global counter of its names would make
    ``torch.compile`` compile the step again at every step.
    """
    if keras_backend() == "torch":
        import torch

        return torch.nn.functional.pad(t, [w for pair in reversed(width) for w in pair])
    return ops.pad(t, width)


def wrapped(ids, rows: int):
    """Negative ids counted from the end, as ``keras.ops.take`` counts them (``-1``: the last row)."""
    return ops.where(ops.less(ids, 0), ops.add(ids, ops.cast(rows, ids.dtype)), ids)


def lookup(ids, table):
    """``Embedding``'s product: the rows of ``table`` at ``ids`` (its gradient is the looked-up rows' own)."""
    return ops.take(table, ids, axis=0)


def looked_up(table, ids, taken: Taken):
    """``Embedding``'s lookup of ``ids`` in ``table`` (a Keras variable) whose gradient costs the batch, not the table.

    TensorFlow reads the rows from the resource (``tf.gather`` of the variable, as
    ``tf.nn.embedding_lookup`` does): the gradient is Keras' own
    ``IndexedSlices`` of the batch's rows, bit for bit, and the table is never
    read whole (a variable ``compact`` writes sparsely would copy itself at
    every whole read). JAX and PyTorch compute the gradient of ``taken``'s
    rows only (:func:`sliced_product` of :func:`lookup`).
    """
    if keras_backend() == "tensorflow":
        import tensorflow as tf

        resource = getattr(table, "value", table)
        if isinstance(resource, tf.Variable):  # tf.gather of a variable reads the rows (ResourceGather)
            return tf.gather(resource, wrapped(ids, int(table.shape[0])))
        return lookup(ids, ops.convert_to_tensor(table))
    return sliced_product(lookup, ids, ops.convert_to_tensor(table), taken)


def sliced_product(op: Callable, x, kernel, taken: Taken):
    """``op(x, kernel)`` whose kernel gradient is the weight gradient of ``taken``'s block only.

    Args:
        op: ``(x, kernel) -> y``, linear in the kernel (the layer's own product).
        x: the layer's input.
        kernel: the kernel's value as the layer reads it (autocast included).
        taken: the block (:class:`Taken`).

    Returns:
        ``y``, equal to ``op(x, kernel)`` bit for bit, with its input gradient the same too.
    """
    y = op(x, ops.stop_gradient(kernel))
    weight_gradient = taken.gradient_of(op)
    # x reaches the tap without a gradient path: its gradient is the layer's own, from op alone
    return _TAPS[keras_backend()](y, ops.stop_gradient(x), kernel, weight_gradient)


def _vjp(op, x, k, dy):
    """The gradient of ``sum(op(x, k) * dy)`` with respect to ``k``: the backend's own rule for ``op``."""
    backend = keras_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(k)
            y = op(x, k)
        return tape.gradient(y, k, output_gradients=dy)
    if backend == "jax":
        import jax

        return jax.vjp(lambda kk: op(x, kk), k)[1](dy)[0]
    import torch

    with torch.enable_grad():  # slices are strided views; PyTorch's CPU convolutions want them contiguous
        kk = k.detach().contiguous().requires_grad_(True)
        y = op(x.detach().contiguous(), kk)
        return torch.autograd.grad(y, kk, dy.contiguous())[0]


def _tap_tensorflow(y, x, k, weight_gradient):
    import tensorflow as tf

    @tf.custom_gradient
    def tap(y, x, k):
        def grad(dy):
            return dy, None, weight_gradient(x, dy, k)

        return tf.identity(y), grad

    return tap(y, x, k)


def _tap_jax(y, x, k, weight_gradient):
    import jax

    @jax.custom_vjp
    def tap(y, x, k):
        return y

    def fwd(y, x, k):
        return y, (x, k)

    def bwd(res, dy):
        x, k = res
        return dy, None, weight_gradient(x, dy, k)

    tap.defvjp(fwd, bwd)
    return tap(y, x, k)


_TORCH_TAP: list = []  # the autograd.Function, made once (torch.compile guards on its class)


def _tap_torch(y, x, k, weight_gradient):
    if not _TORCH_TAP:
        import torch

        class Tap(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y, x, k, weight_gradient):
                ctx.save_for_backward(x, k)
                ctx.weight_gradient = weight_gradient
                return y.view_as(y)

            @staticmethod
            def backward(ctx, dy):
                x, k = ctx.saved_tensors
                return dy, None, ctx.weight_gradient(x, dy, k), None

        _TORCH_TAP.append(Tap)
    return _TORCH_TAP[0].apply(y, x, k, weight_gradient)


_TAPS: dict[str, Callable] = {"tensorflow": _tap_tensorflow, "jax": _tap_jax, "torch": _tap_torch}
