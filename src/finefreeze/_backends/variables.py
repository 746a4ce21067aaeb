"""The per-backend seam: the few operations that differ between Keras backends.

Strategies are written once with ``keras.ops``. What is truly backend
specific lives here and nowhere else:

- TensorFlow: writes under ``tf.distribute`` go through ``merge_call`` and
  ``extended.update`` (every replica's copy); sparse ``IndexedSlices``
  gradients (embeddings) stay sparse; compact results are scattered in place
  with ``scatter_nd_update``; a build traced inside ``tf.function`` reads
  values under ``tf.init_scope``.
- JAX and PyTorch: plain ``variable.assign`` (inside JAX's stateless,
  jitted train step the assignments are recorded by Keras' StatelessScope);
  compact results are written with a functional ``scatter_update`` into the
  flattened value (eager PyTorch writes the elements in place, as Keras'
  own ``assign`` writes its value); a JAX snapshot is the (immutable) value
  itself.

TensorFlow is imported only when it is the Keras backend.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import keras
from keras import ops

from finefreeze._backends.arrays import native
from finefreeze._backends.distribute import owner_scope
from finefreeze._backends.questions import keras_backend, keras_is_jax, tensorflow, tensorflow_imported

__all__ = [
    "IN_PLACE_FLAG",
    "block_write",
    "read_block",
    "take_block",
    "is_sparse",
    "current",
    "own_buffers",
    "unravel",
    "eager_scope",
    "flat_dense",
    "scatter_write",
    "select_frozen_to_zero",
    "snapshot",
    "take_trainable",
    "take_values",
    "write_all",
]


#: XLA on a CPU copies a donated variable that a step both reads and updates in part (a block or some
#: elements written back into a kernel), unless its copy insertion uses region analysis (benchmarks/llm_memory.py)
IN_PLACE_FLAG = "--xla_cpu_copy_insertion_use_region_analysis"


def prefer_in_place_updates() -> bool:
    """On JAX, let XLA write a variable's updated part in place (set before JAX starts; True if set now).

    A partially frozen kernel's trained part is written back into the kernel
    inside the step. XLA on a CPU keeps the kernel's old value for the
    step's other reads with a copy of the whole kernel, unless its copy
    insertion uses region analysis (XLA on a GPU does by default): this
    adds ``--xla_cpu_copy_insertion_use_region_analysis=true`` to
    ``XLA_FLAGS`` when JAX has not started yet and the user set nothing
    for it (``=false`` in ``XLA_FLAGS`` keeps XLA's default).
    """
    if not keras_is_jax() or IN_PLACE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {IN_PLACE_FLAG}=true".strip()
    return True


prefer_in_place_updates()


def snapshot(v):
    """A tensor holding the variable's value now, unaffected by later writes.

    JAX arrays are immutable: the value itself (a copy would cost a pass over
    the variable inside the jitted step). PyTorch updates in place: a copy.
    """
    tf = tensorflow()
    if tf is not None:
        return tf.identity(native(v))
    if keras_is_jax():
        return v.value
    return keras.ops.copy(v.value)


def current(v):
    """The variable's value now, read to compute a value that is then written back to it.

    No copy off TensorFlow (whatever is computed from it is a new tensor);
    TensorFlow reads it as :func:`snapshot` does.
    """
    if tensorflow() is not None:
        return snapshot(v)
    return v.value


def is_sparse(grad) -> bool:
    """Whether ``grad`` is sparse: TensorFlow's ``IndexedSlices``, or a PyTorch sparse tensor (sliced embeddings)."""
    tf = tensorflow_imported()
    return (tf is not None and isinstance(grad, tf.IndexedSlices)) or _torch_sparse(grad)


def _torch_sparse(grad) -> bool:
    return keras_backend() == "torch" and getattr(grad, "is_sparse", False) is True


def select_frozen_to_zero(mask, grad):
    """``grad`` with frozen elements (``mask`` True) selected to 0 (``where``, never a product)."""
    if _torch_sparse(grad):
        grad = grad.to_dense()
    if is_sparse(grad):  # TensorFlow embeddings: stay sparse, select the touched rows only
        tf = tensorflow_imported()
        rows = tf.gather(mask, grad.indices)
        values = tf.where(rows, tf.zeros_like(grad.values), grad.values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    grad = keras.ops.convert_to_tensor(grad)
    return keras.ops.where(mask, keras.ops.zeros_like(grad), grad)


def take_values(v, idx):
    """The variable's values now at the flat indices ``idx``: a gather from its value, a new tensor.

    A dense read shares the variable's buffer (no copy); TensorFlow's sparse
    reads (``ResourceGatherNd``) would switch the variable to copying at
    every dense read, the step's forward pass included.
    """
    return ops.take(ops.reshape(current_value(v), (-1,)), idx, axis=0)


def current_value(v):
    """The variable's value now, read densely (TensorFlow: one read op, sharing the variable's buffer)."""
    tf = tensorflow()
    if tf is not None:
        return tf.convert_to_tensor(native(v))
    return v.value


def take_trainable(grad, idx, shape, block: tuple | None = None):
    """The gradient of a compact vector: ``grad`` at the sorted flat indices ``idx`` of a variable of ``shape``.

    A dense gradient is flattened and gathered. A sparse one (``IndexedSlices``
    of a TensorFlow embedding) stays sparse and is never densified: for each
    row it touches, two ``searchsorted`` on ``idx`` (which XLA compiles) find
    the run of trainable elements inside that row, and its entries become
    entries of an ``IndexedSlices`` over the vector, in their order,
    duplicates kept. The unused slots (frozen elements) are ``0.0`` at
    position 0; adding ``+0.0`` changes no sum, so the inner optimizer's
    sparse update of the vector equals its update of those elements in the
    whole table, bit for bit, at the cost of the batch's rows rather than of
    the table. Where the elements are a block of whole rows (``block``: new
    rows of a table), :func:`_take_rows` finds the same entries by rows.
    """
    rows = _row_range(shape, block)
    if _torch_sparse(grad):
        return _torch_take_rows(grad, idx, shape, rows)
    if not is_sparse(grad):
        return ops.take(flat_dense(grad), idx, axis=0)
    if rows is not None:
        return _take_rows(grad, rows, shape, idx.dtype)
    tf = tensorflow_imported()
    row = math.prod(shape[1:])
    k = tf.shape(idx, out_type=idx.dtype)[0]
    start = tf.cast(grad.indices, idx.dtype) * row
    lo = tf.searchsorted(idx, start)  # the row's first trainable element in idx
    count = tf.searchsorted(idx, start + row) - lo
    rows = tf.reshape(grad.values, (-1, row))
    if not in_xla():  # keep only the entries of rows with trainable elements (XLA needs static shapes)
        hit = tf.reshape(tf.where(count > 0), (-1,))
        start, lo, count, rows = (tf.gather(t, hit) for t in (start, lo, count, rows))
    slot = tf.range(row, dtype=idx.dtype)[None, :]
    pos = tf.minimum(lo[:, None] + slot, k - 1)  # (n, row): where each slot's element sits in the vector
    used = slot < count[:, None]
    col = tf.where(used, tf.gather(idx, pos) - start[:, None], tf.zeros_like(pos))
    base = tf.range(tf.shape(rows, out_type=idx.dtype)[0], dtype=idx.dtype)[:, None] * row
    values = tf.gather(tf.reshape(rows, (-1,)), base + col)
    values = tf.where(used, values, tf.zeros_like(values))
    index = tf.where(used, pos, tf.zeros_like(pos))
    return tf.IndexedSlices(tf.reshape(values, (-1,)), tf.reshape(index, (-1,)), tf.reshape(k, (1,)))


def _row_range(shape, block: tuple | None) -> tuple[int, int] | None:
    """``(first row, number of rows)`` of a block of whole rows of a variable of ``shape``; None for any other."""
    if block is None or not _row_block(shape, block):
        return None
    lo = block[0].start or 0
    return lo, block[0].stop - lo


def _take_rows(grad, block_rows: tuple[int, int], shape, dtype):
    """:func:`take_trainable` of ``IndexedSlices`` for a block of whole rows: the same entries, found by rows.

    Each entry (a row of the table) inside the block gives its ``width``
    elements at their place in ``compact``'s vector (the block's rows, flat),
    in order, duplicates kept: an entry's row minus the block's first row
    locates it, where :func:`take_trainable` searches the vector for every
    entry's elements. Outside the block, an XLA step keeps the entries (static
    shapes) as ``0.0`` at position 0; a graph step drops them.
    """
    tf = tensorflow_imported()
    (lo, n), width = block_rows, math.prod(shape[1:])
    pos = tf.cast(grad.indices, dtype) - lo
    inside = (pos >= 0) & (pos < n)
    rows = tf.reshape(grad.values, (-1, width))
    if in_xla():
        rows = tf.where(inside[:, None], rows, tf.zeros_like(rows))
        pos = tf.where(inside, pos, tf.zeros_like(pos))
        slot = tf.where(inside[:, None], tf.range(width, dtype=dtype)[None, :], tf.zeros((1, width), dtype))
    else:
        hit = tf.reshape(tf.where(inside), (-1,))
        rows, pos = tf.gather(rows, hit), tf.gather(pos, hit)
        slot = tf.range(width, dtype=dtype)[None, :]
    index = pos[:, None] * width + slot
    return tf.IndexedSlices(tf.reshape(rows, (-1,)), tf.reshape(index, (-1,)), tf.constant([n * width], dtype))


def _torch_take_rows(grad, idx, shape, block_rows=None):
    """The elements at ``idx`` of a PyTorch sparse gradient of rows (0 in rows it holds no value for)."""
    import torch

    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values().reshape(grad.indices().shape[1], -1)
    if rows.numel() == 0:
        return torch.zeros(idx.shape, dtype=values.dtype, device=values.device)
    if block_rows is not None:  # a block of whole rows, flat: each row at its place
        lo, n = block_rows
        rows = rows - lo
        inside = torch.nonzero((rows >= 0) & (rows < n)).squeeze(1)
        out = torch.zeros((n, values.shape[1]), dtype=values.dtype, device=values.device)
        return out.index_copy_(0, rows.index_select(0, inside), values.index_select(0, inside)).reshape(-1)
    width = math.prod(shape[1:])
    idx = idx.long()
    want = idx // width
    at = torch.searchsorted(rows, want).clamp(max=rows.numel() - 1)
    found = values[at, idx % width]
    return torch.where(rows[at] == want, found, torch.zeros_like(found))


def in_xla() -> bool:
    """Whether the graph being built compiles with XLA (``jit_compile=True``), where shapes must be static."""
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tensorflow_imported().compat.v1.get_default_graph()))
    except (ImportError, AttributeError):  # an internal module moved: take the static path, always correct
        return True


def flat_dense(grad):
    """``grad`` as a dense flat tensor (a sparse one is densified)."""
    if _torch_sparse(grad):
        grad = grad.to_dense()
    if is_sparse(grad):
        grad = tensorflow_imported().convert_to_tensor(grad)
    return keras.ops.reshape(keras.ops.convert_to_tensor(grad), (-1,))


def unravel(flat, shape):
    """Flat indices to ``(k, ndim)`` indices, with ``keras.ops`` that XLA compiles.

    The arithmetic runs in the dtype of ``flat``: int64 indices (variables of
    2**31 elements or more) never wrap around.
    """
    if len(shape) <= 1:
        return ops.expand_dims(flat, 1)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    strides.reverse()
    dtype = ops.dtype(flat)
    return ops.stack([(flat // ops.cast(s, dtype)) % ops.cast(d, dtype) for s, d in zip(strides, shape)], axis=1)


def assign(var, value):
    return var.assign(value)


def _tf_scatter(var, indices, values):
    return var.scatter_nd_update(indices, values)


def _in_place(var) -> bool:
    """Whether a PyTorch variable's value is written in place (as Keras' ``assign`` does): eager and contiguous.

    ``slice_update`` and ``scatter_update`` would copy the whole variable
    first, then ``assign`` copy it back: two passes over a table of which a
    few rows changed. Traced (``torch.compile``) or stateless steps keep the
    functional form.
    """
    if keras_backend() != "torch":
        return False
    import torch
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    value = var.value
    return not in_stateless_scope() and not torch.compiler.is_compiling() and value.is_contiguous()


def _functional_scatter(var, flat_index, values):
    if _in_place(var):
        import torch

        with torch.no_grad():
            var.value.view(-1).index_copy_(0, flat_index.long(), values.to(var.value.dtype))
        return var
    flat = keras.ops.reshape(var.value, (-1,))
    flat = keras.ops.scatter_update(flat, keras.ops.expand_dims(flat_index, 1), values)
    return var.assign(keras.ops.reshape(flat, var.shape))


def _row_block(shape, block) -> bool:
    """Whether ``block`` is whole rows of a variable of ``shape`` (a range along axis 0 only)."""
    return all((b.start or 0) == 0 and b.stop == n for b, n in zip(block[1:], shape[1:]))


def read_block(v, block: tuple, idx):
    """The elements of ``v`` in the block ``block`` (flat, C order); ``idx``: their flat indices.

    A slice of the value, read densely (:func:`current_value`): the read is
    done before the block's write, which then writes in place.
    """
    return take_block(current_value(v), block)


def take_block(t, block: tuple):
    """``t[block]`` flattened: the elements of a block of ranges (a tuple of slices), in C order."""
    return ops.reshape(ops.convert_to_tensor(t)[block], (-1,))


def _tf_block(var, values, block=()):
    return var[block].assign(values)  # ResourceStridedSliceAssign: in place once the step's reads are done


def _functional_block(var, values, block=()):
    if _in_place(var):
        import torch

        with torch.no_grad():
            var.value[block].copy_(values)
        return var
    start = [s.start or 0 for s in block]
    return var.assign(ops.slice_update(var.value, start, values))


def block_write(variable, block: tuple, values) -> tuple:
    """A write (for :func:`write_all`) that puts ``values`` (flat, C order) into the block ``block`` of ``variable``.

    TensorFlow scatters the rows of a block of whole rows
    (``ResourceScatterUpdate``: a strided slice assign copies a large table
    first) and assigns any other block's slice in place
    (``ResourceStridedSliceAssign``); JAX and PyTorch update the slice of the
    value (``slice_update``; eager PyTorch writes it in place).
    """
    shape = tuple(s.stop - (s.start or 0) for s in block)
    fn = _tf_block if tensorflow() is not None else _functional_block
    return (variable, functools.partial(fn, block=block), (ops.reshape(values, shape),))


def scatter_write(variable, flat_index, values) -> tuple:
    """A write (for :func:`write_all`) that puts ``values`` at the flat indices ``flat_index`` of ``variable``.

    TensorFlow scatters in place into the variable (``scatter_nd_update`` with
    ``(k, ndim)`` indices); JAX and PyTorch scatter into the flattened value,
    which needs no index arithmetic (XLA updates a donated buffer in place).
    """
    if tensorflow() is not None:
        return (variable, _tf_scatter, (unravel(flat_index, tuple(int(d) for d in variable.shape)), values))
    return (variable, _functional_scatter, (flat_index, values))


def write_all(writes, after=()) -> None:
    """Perform ``[(variable, fn, args)]`` writes through the backend's update path.

    Under ``tf.distribute`` a write from replica context goes through
    ``merge_call`` and ``extended.update``, which runs ``fn`` on every
    replica's copy with that replica's ``args``; a bare replica-context
    ``assign`` would aggregate the replicas' values (``aggregation="mean"``
    rounds them). Elsewhere this is a plain call of each ``fn``.

    ``after``: tensors (the step's gradients) a TensorFlow graph computes
    before the writes. A variable written in part is read by the step's
    backward pass too (``dx = dy · kernelᵀ``), and TensorFlow copies a
    variable whose buffer a read still shares when it is written: once every
    gradient exists, every such read is done and the write is in place.
    """
    if not writes:
        return
    tf = tensorflow()
    if tf is None:
        for var, fn, args in writes:
            fn(var, *args)
        return
    after = [getattr(g, "values", g) for g in after if g is not None]
    if after and not tf.executing_eagerly():
        with tf.control_dependencies(after):
            write_all(writes)
        return
    tf_vars = [native(v) for v, _, _ in writes]

    def merged(strategy, *all_args):
        for var, (_, fn, _), args in zip(tf_vars, writes, all_args):
            strategy.extended.update(var, fn, args=args, group=False)

    args = [a for _, _, a in writes]
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
        tf.__internal__.distribute.interim.maybe_merge_call(merged, tf.distribute.get_strategy(), *args)
        return
    with owner_scope(tf_vars):  # e.g. finalize_variable_values after fit, outside the scope
        merged(tf.distribute.get_strategy(), *args)


def eager_scope():
    """A context where variable values can be read eagerly, even while TensorFlow traces a function."""
    tf = tensorflow()
    return tf.init_scope() if tf is not None else contextlib.nullcontext()


def own_buffers(variables) -> None:
    """Give each variable a buffer of its own after an overwrite that may have shared one (off TensorFlow).

    The EMA overwrite (``finalize_variable_values``) makes each variable share
    its buffer with its average; JAX's next train step donates both and fails
    (plain Keras 3.15 too).
    """
    if tensorflow() is not None:
        return
    for v in variables:
        v.assign(ops.copy(v.value))
