"""The backend interface on PyTorch (see ``functional``): writes in place where eager, sparse embedding rows.

``slice_update`` and ``scatter_update`` would copy the whole variable
first, then ``assign`` copy it back: two passes over a table of which a few
rows changed. An eager, contiguous variable is written in place (as Keras'
own ``assign`` writes its value); traced (``torch.compile``) or stateless
steps keep the functional form.
"""

from __future__ import annotations

import functools
import math
import warnings

import keras
import numpy as np

from finefreeze._backends import functional, gathered
from finefreeze._backends.functional import *  # noqa: F403  (the defaults this module does not override)
from finefreeze._keras.instances import in_stateless_scope

__all__ = [*functional.__all__]  # the whole interface: ``functional``'s, some of it overridden here

SPARSE_LOOKUPS = False
INT64_INDICES_ONLY = True  # index_put_ takes int64 indices only
PAIRS_BY_POSITION = False


def backend_variable(variable):
    """The ``torch.nn.Parameter`` inside a ``keras.Variable`` (it lives as long as the variable; writes are in place)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def index_constant(index: np.ndarray):
    """``index`` as a tensor, made once: ``torch.compile`` traces no NumPy array an op converts in the step."""
    return keras.ops.convert_to_tensor(index)


def is_sparse(grad) -> bool:
    """Whether ``grad`` is a PyTorch sparse tensor (a sliced embedding's rows)."""
    return getattr(grad, "is_sparse", False) is True


def densify(grad):
    """``grad`` as a dense tensor."""
    return grad.to_dense() if is_sparse(grad) else keras.ops.convert_to_tensor(grad)


def select_frozen_to_zero(mask, grad):
    """``grad`` (densified) with frozen elements (``mask`` True) selected to 0."""
    return functional.select_frozen_to_zero(mask, densify(grad))


def take_sparse(grad, idx, shape):
    """The elements at ``idx`` of a sparse gradient of rows (0 in rows it holds no value for)."""
    import torch

    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values().reshape(grad.indices().shape[1], -1)
    if rows.numel() == 0:
        return torch.zeros(idx.shape, dtype=values.dtype, device=values.device)
    width = math.prod(shape[1:])
    idx = idx.long()
    want = idx // width
    at = torch.searchsorted(rows, want).clamp(max=rows.numel() - 1)
    found = values[at, idx % width]
    return torch.where(rows[at] == want, found, torch.zeros_like(found))


def _in_place(var) -> bool:
    """Whether ``var``'s value is written in place: eager, not stateless, contiguous."""
    import torch

    return not in_stateless_scope() and not torch.compiler.is_compiling() and var.value.is_contiguous()


def _scatter(var, flat_index, values):
    if not _in_place(var):
        return functional._scatter(var, flat_index, values)
    import torch

    with torch.no_grad():
        var.value.view(-1).index_copy_(0, flat_index.long(), values.to(var.value.dtype))
    return var


def scatter_write(variable, flat_index, values) -> tuple:
    """A write (for ``write_all``) that puts ``values`` at ``flat_index``: in place where eager."""
    return (variable, _scatter, (flat_index, values))


def _block(var, values, block=()):
    if not _in_place(var):
        return functional._block(var, values, block)
    import torch

    with torch.no_grad():
        var.value[block].copy_(values)
    return var


def block_write(variable, block: tuple, values) -> tuple:
    """A write (for ``write_all``) that puts ``values`` into the slice ``block``: in place where eager."""
    return (variable, functools.partial(_block, block=block), (values,))


def read_elements(variable, index: np.ndarray | None) -> np.ndarray:
    """A copy of ``variable``'s elements at ``index``: indexed on the value (int64 indices, taken as they are)."""
    if index is None or index.dtype != np.int64 or not variable.value.is_contiguous():
        return functional.read_elements(variable, index)
    import torch

    with torch.no_grad():
        return keras.ops.convert_to_numpy(variable.value.view(-1)[torch.from_numpy(index)])


def write_elements(variable, index: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` at ``index``: ``index_put_`` into the flattened value under ``no_grad``."""
    import torch

    value = variable.value
    if not value.is_contiguous():
        functional.write_elements(variable, index, values)
        return
    with torch.no_grad():
        flat = value.view(-1)
        where = torch.from_numpy(index) if index.dtype == np.int64 else torch.as_tensor(index).long()
        new = keras.ops.convert_to_tensor(values, dtype=variable.dtype)  # NumPy has no bfloat16 of torch's
        flat.index_put_((where.to(flat.device),), new.to(device=flat.device, dtype=flat.dtype))


def tap(y, x, k, s, weight_gradient):
    """``y`` through a ``torch.autograd.Function`` whose backward hands ``dy`` on and gives ``s`` its gradient."""
    from finefreeze._backends.torch.autograd_function import Tap

    return Tap.apply(y, x, k, s, weight_gradient)


def vjp(op, x, k, dy):
    """The gradient of ``sum(op(x, k) * dy)`` with respect to ``k``: ``torch.autograd.grad``.

    ``torch.compile`` traces no ``autograd.grad``: a compiled step runs the
    backward of a block's product as Python (``torch.func.vjp``, which it
    traces, leaks its transform into the rest of Keras' compiled step).
    """
    import torch

    with torch.enable_grad():  # slices are strided views; PyTorch's CPU convolutions want them contiguous
        kk = k.detach().contiguous().requires_grad_(True)
        y = op(x.detach().contiguous(), kk)
        return torch.autograd.grad(y, kk, dy.contiguous())[0]


def rows_gradient(taken, segment, dy):
    """A table's trained rows' gradient: ``index_add_`` of the block's entries (Keras' segment_sum repeats ids)."""
    import torch

    n, width = taken.block_shape[0], taken.shape[1]
    segment = segment.long()
    inside = torch.nonzero(segment < n).squeeze(1)  # the block's entries, in their order
    rows = torch.zeros((n, width), dtype=dy.dtype, device=dy.device)
    rows = rows.index_add_(0, segment.index_select(0, inside), dy.index_select(0, inside))
    return taken.trained(rows)


def add_rows(rows, at, count: int):
    """``functional.add_rows`` with ``index_add_``: Keras' ``segment_sum`` widens the indices to ``rows``' shape."""
    import torch

    rows = keras.ops.convert_to_tensor(rows)
    out = torch.zeros((count, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return out.index_add_(0, keras.ops.convert_to_tensor(at).long(), rows)


def scattered_product(t, values, take_at, add_at, width: int, chunk: int):
    """``functional.scattered_product`` as a product with a compressed sparse row (CSR) matrix: the pairs.

    ``t`` times the ``(A, width)`` matrix that is ``values`` at the pairs:
    its transpose (rows ``add_at``, sorted here) as a sparse CSR tensor
    times ``t``'s transpose. No gathered copy of ``t``'s columns and no
    loop: 4 to 6 times as fast as the gathers summed by ``index_add_`` on a
    CPU at 1 % of a 152 M LLM's kernel shapes (``benchmarks/sampled.py
    --scattered``).
    Half-precision values are summed in float32, as a matmul sums them.
    Inside ``torch.compile`` (which traces no sparse tensors) the gathers.
    """
    import torch

    if torch.compiler.is_compiling():
        return gathered.spread(t, values, take_at, add_at, width, chunk, transposed, add_rows)
    t, values = keras.ops.convert_to_tensor(t), keras.ops.convert_to_tensor(values)
    dtype, across = t.dtype, t.shape[1]
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    rows, cols = keras.ops.convert_to_tensor(add_at).long(), keras.ops.convert_to_tensor(take_at).long()
    order = torch.argsort(rows * across + cols)
    rows, cols = rows[order], cols[order]
    crow = torch.searchsorted(rows, torch.arange(width + 1, device=rows.device))  # each row's first pair
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", once a process
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support", category=UserWarning)
        matrix = torch.sparse_csr_tensor(crow, cols, values.to(wide)[order], (width, across), check_invariants=False)
    return (matrix @ t.to(wide).T.contiguous()).T.to(dtype)


def transposed(t):
    """The transpose of ``t`` copied row-contiguous: ``t.T`` is a view, whose rows a gather would read strided."""
    return keras.ops.convert_to_tensor(t).T.contiguous()


def sampled_dots(x, dy, flat, columns, order: str | None, chunk: int, window=None):
    """Each pair's ``sum_n x[n, a] * dy[n, b]``: PyTorch's sampled dense-dense product (``sampled_addmm``).

    The pairs are the pattern of a sparse CSR matrix (rows ``a``, or ``b``
    where the pairs are sorted by it; sorted here where neither, and the
    sums put back in the pairs' order); ``torch.sparse.sampled_addmm``
    computes the dot products at that pattern only, with no gather of
    columns and nothing of the kernel's shape (15 times faster than the
    gathers on a CPU at 1 % of a 1024 x 4096 kernel). Inside
    ``torch.compile`` (which traces no sparse tensors) the gathers of
    ``functional``.
    """
    import torch

    if torch.compiler.is_compiling():
        # (no windows: a slice at a tensor's offset is a value torch.compile would have to read in the step)
        return gathered.gathered_dots(x, dy, flat, columns, chunk, transposed, map_in_turn)
    x, dy = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(dy)
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    a, b = columns(keras.ops.convert_to_tensor(flat))
    a, b = a.long(), b.long()
    if order == "b":
        rows, cols, left, right = b, a, dy.to(wide).T, x.to(wide)
    else:
        rows, cols, left, right = a, b, x.to(wide).T, dy.to(wide)
    n_rows, n_cols = left.shape[0], right.shape[1]
    perm = None
    if order is None:
        perm = torch.argsort(rows * n_cols + cols)
        rows, cols = rows[perm], cols[perm]
    crow = torch.searchsorted(rows, torch.arange(n_rows + 1, device=rows.device))  # each row's first pair
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state", once a process
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support", category=UserWarning)
        pattern = torch.sparse_csr_tensor(
            crow,
            cols,
            torch.zeros(rows.shape[0], dtype=wide, device=left.device),
            (n_rows, n_cols),
            check_invariants=False,
        )
    sums = torch.sparse.sampled_addmm(pattern, left, right, beta=0.0).values()
    if perm is None:
        return sums
    return torch.empty_like(sums).index_copy_(0, perm, sums)


def map_in_turn(fn, xs, dtype: str):
    """``fn`` over the first axis of ``xs`` (a tensor, or a tuple of them) in a Python loop, results stacked.

    Keras' ``map`` scans with more work.
    """
    import torch

    if isinstance(xs, tuple):
        return torch.stack([fn(x) for x in zip(*(keras.ops.convert_to_tensor(t) for t in xs))])
    return torch.stack([fn(x) for x in keras.ops.convert_to_tensor(xs)])


def nadam_product_step(product, beta_1, factor):
    """Nadam's running product moved on by one step, in the order PyTorch's fused Nadam takes it."""
    return product * (beta_1 * factor)
