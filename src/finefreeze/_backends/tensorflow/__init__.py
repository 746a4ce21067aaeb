"""The backend interface on TensorFlow (see ``functional``): resource writes in place, ``tf.distribute``, sparse rows.

- Writes under ``tf.distribute`` go through ``merge_call`` and
  ``extended.update`` (every replica's copy); compact results are written
  in place (``scatter_nd_update``, ``ResourceStridedSliceAssign``), and the
  variable's whole reads then share its buffer again (:func:`_sharing`); a
  build traced inside ``tf.function`` reads values under ``tf.init_scope``.
- Sparse ``IndexedSlices`` gradients (embeddings) stay sparse.

Imported only when TensorFlow is the Keras backend.
"""

from __future__ import annotations

import contextlib
import functools
import math

import keras
import numpy as np
import tensorflow as tf

from finefreeze._backends import functional, gathered
from finefreeze._backends.arrays import native, unravel
from finefreeze._backends.distribute import owner_scope
from finefreeze._backends.functional import *  # noqa: F403  (the defaults this module does not override)
from finefreeze._keras.instances import outside_the_trace

__all__ = [*functional.__all__]  # the whole interface: ``functional``'s, some of it overridden here

SPARSE_LOOKUPS = True  # an Embedding's gradient is IndexedSlices
INT64_INDICES_ONLY = False
PAIRS_BY_POSITION = False


def snapshot(v):
    """A tensor holding the variable's value now, unaffected by later writes (``tf.identity``)."""
    return tf.identity(native(v))


def current(v):
    """The variable's value now, read as :func:`snapshot` reads it."""
    return snapshot(v)


def current_value(v):
    """The variable's value now, read densely: one read op, sharing the variable's buffer."""
    return tf.convert_to_tensor(native(v))


def as_optimizers_see(variable):
    """The ``tf.Variable`` inside a ``keras.Variable``: what Keras' ``apply`` hands ``_use_weight_decay``."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def backend_variable(variable):
    """The ``tf.Variable`` inside a ``keras.Variable`` (a custom loop may hand the optimizer those)."""
    return native(variable)


def is_sparse(grad) -> bool:
    """Whether ``grad`` is ``IndexedSlices`` (an embedding's gradient)."""
    return isinstance(grad, tf.IndexedSlices)


def densify(grad):
    """``grad`` as a dense tensor."""
    return tf.convert_to_tensor(grad)


def select_frozen_to_zero(mask, grad):
    """``grad`` with frozen elements selected to 0; ``IndexedSlices`` stay sparse (the touched rows only)."""
    if not is_sparse(grad):
        return functional.select_frozen_to_zero(mask, grad)
    rows = tf.gather(mask, grad.indices)
    values = tf.where(rows, tf.zeros_like(grad.values), grad.values)
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)


def take_sparse(grad, idx, shape):
    """``IndexedSlices`` over a compact vector: the entries of ``grad`` at the sorted flat indices ``idx``.

    For each row it touches, two ``searchsorted`` on ``idx`` (which XLA
    compiles) find the run of trainable elements inside that row, and its
    entries become entries over the vector, in their order, duplicates kept.
    The unused slots (frozen elements) are ``0.0`` at position 0; adding
    ``+0.0`` changes no sum, so the inner optimizer's sparse update of the
    vector equals its update of those elements in the whole table, bit for
    bit.
    """
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


def spread_sparse(standin_grad, trained: np.ndarray, shape):
    """A stand-in's ``IndexedSlices`` as its table's: one whole row per entry, duplicates kept, as Keras' own.

    Frozen elements of a row are ``0.0`` at place 0, below the row's own
    elements, so each entry's row is the largest place's.
    """
    width = int(shape[1])
    values = tf.reshape(standin_grad.values, (-1, width))
    places = tf.reshape(tf.gather(tf.constant(trained), standin_grad.indices), (-1, width))
    rows = tf.reduce_max(places // width, axis=1)
    return tf.IndexedSlices(values, rows, tf.constant(list(shape), dtype=rows.dtype))


def in_xla() -> bool:
    """Whether the graph being built compiles with XLA (``jit_compile=True``), where shapes must be static."""
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except (ImportError, AttributeError):  # an internal module moved: take the static path, always correct
        return True


def _sharing(var, result):
    """``result`` (of a sparse op on ``var``), and ``var``'s whole reads sharing its buffer again.

    Any sparse op on a variable (``ResourceScatterNdUpdate``,
    ``ResourceStridedSliceAssign``, ``ResourceGather``) puts it in
    TensorFlow's copy-on-read mode, where every whole read copies it: a
    kernel's forward read, held to the backward pass, and a table's lookup
    would copy them at every step. ``DisableCopyOnRead`` ends the mode. The
    next sparse op copies the variable first only if a read still holds its
    buffer (TensorFlow's copy-on-write keeps that read's values): a write
    after the step's gradients finds none, and writes in place. Done where
    the writes are ordered with the variable's other ops (eagerly, and in
    ``tf.function``'s automatic control dependencies); XLA owns its buffers.
    """
    if in_xla() or not (tf.executing_eagerly() or tf.inside_function()):
        return result
    tf.raw_ops.DisableCopyOnRead(resource=var.handle)
    return result


def _scatter(var, indices, values):
    return _sharing(var, var.scatter_nd_update(indices, values))


def scatter_write(variable, flat_index, values) -> tuple:
    """A write (for :func:`write_all`) scattering in place into the variable (``(k, ndim)`` indices)."""
    return (variable, _scatter, (unravel(flat_index, tuple(int(d) for d in variable.shape)), values))


def _block(var, values, block=()):
    if in_xla():
        return var[block].assign(values)
    # the raw op: ``var[block].assign`` reads the whole variable first (a read the write must wait for)
    begin, end = [s.start or 0 for s in block], [s.stop for s in block]
    write = tf.raw_ops.ResourceStridedSliceAssign(
        ref=var.handle, begin=begin, end=end, strides=[1] * len(block), value=tf.cast(values, var.dtype)
    )
    return _sharing(var, write)


def block_write(variable, block: tuple, values) -> tuple:
    """A write (for :func:`write_all`) assigning the slice ``block`` in place (``ResourceStridedSliceAssign``)."""
    return (variable, functools.partial(_block, block=block), (values,))


def write_all(writes, after=()) -> None:
    """Perform ``[(variable, fn, args)]`` writes through ``tf.distribute``'s update path.

    A write from replica context goes through ``merge_call`` and
    ``extended.update``, which runs ``fn`` on every replica's copy with that
    replica's ``args``; a bare replica-context ``assign`` would aggregate the
    replicas' values (``aggregation="mean"`` rounds them). ``after``: tensors
    (the step's gradients) a graph computes before the writes, so that every
    read sharing a written variable's buffer is done and the write is in place.
    """
    if not writes:
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


def scattered_product(t, values, take_at, add_at, width: int, chunk: int):
    """``functional.scattered_product`` as a product with a compressed sparse row (CSR) matrix: the pairs.

    ``t`` times the ``(A, width)`` matrix that is ``values`` at the pairs:
    ``tf.raw_ops.SparseMatrixMatMul`` of its transpose (rows ``add_at``,
    sorted here) and ``t``'s. No gathered copy of ``t``'s columns and no
    loop: in TensorFlow's graph the chunked gathers held about 290 MB more
    at the step's peak on a 152 M-parameter LLM's int8 base (1 % of every
    projection's elements; ``benchmarks/llm_memory.py``) and took several
    times as long, as did ``tf.sparse.sparse_dense_matmul``, which takes the
    pairs as a list (``benchmarks/sampled.py --scattered``). Half-precision
    values are summed in float32 (the CSR product has no half-precision
    kernel), as a matmul sums them. XLA has no sparse product: under
    ``jit_compile=True``, the gathers.
    """
    if in_xla():
        return functional.scattered_product(t, values, take_at, add_at, width, chunk)
    dtype = t.dtype
    wide = tf.float64 if dtype == tf.float64 else tf.float32
    at = tf.stack([tf.cast(add_at, tf.int64), tf.cast(take_at, tf.int64)], axis=1)  # the matrix's transpose
    shape = tf.constant([width, int(t.shape[1])], tf.int64)
    pairs = tf.sparse.reorder(tf.sparse.SparseTensor(at, tf.cast(values, wide), shape))
    matrix = tf.raw_ops.SparseTensorToCSRSparseMatrix(indices=pairs.indices, values=pairs.values, dense_shape=shape)
    # (matrix^T t^T)^T with the transposes made here: the product's own flags took half as long again
    out = tf.transpose(tf.raw_ops.SparseMatrixMatMul(a=matrix, b=tf.transpose(tf.cast(t, wide))))
    return tf.cast(out, dtype)


def sampled_dots(x, dy, flat, columns, order, chunk: int, window=None):
    """``functional.sampled_dots`` with TensorFlow's ``map_in_turn`` (one chunk at a time) and ``tf.gather``.

    ``x`` (a layer's input, kept from the forward pass) is read once ``dy``
    exists (a control dependency): otherwise the executor may transpose
    every layer's input as soon as the backward pass starts, and hold each
    transpose until that layer's product runs (about 150 MB of a 152 M
    LLM's step at 1 % of every projection's elements;
    ``benchmarks/llm_memory.py``). ``tf.gather`` instead of
    ``keras.ops.take``, whose handling of negative indices (the columns
    are never negative) was half the operations of the loop's body: a
    graph's operations are memory for as long as the step lives (about
    10 kB each, in the traced function and the runtime's copies), and every
    scattered kernel has its own product.
    """
    with tf.control_dependencies([dy]):
        x = tf.identity(x)
    return gathered.gathered_dots(
        x, dy, flat, columns, chunk, functional.transposed, map_in_turn, tf.gather, order, window, _cut
    )


def _cut(t, lo, w: int):
    """The columns ``lo`` to ``lo + w`` of ``t``, whose rows may be unknown until it runs (a graph for any batch)."""
    lo = tf.cast(lo, tf.int32)
    return tf.slice(t, tf.stack([0, lo]), tf.stack([tf.shape(t)[0], w]))


def map_in_turn(fn, xs, dtype: str):
    """``fn`` over the first axis of ``xs``, one slice after another: ``tf.map_fn`` with one iteration at a time.

    ``keras.ops.map`` runs up to ten iterations at once (``tf.map_fn``'s
    default), each with its chunk's temporaries.
    """
    return tf.map_fn(fn, xs, parallel_iterations=1, fn_output_signature=tf.dtypes.as_dtype(dtype))


def eager_scope():
    """A context where variable values can be read eagerly, even while TensorFlow traces a function."""
    return tf.init_scope()


def build_scope():
    """A context where a build makes its variables eagerly, also while a function is traced.

    Keras builds an optimizer in its first step, while ``tf.function``
    traces it (without a ``tf.distribute`` strategy). A variable made there
    gets its initial value as a constant of the traced graph, which
    TensorFlow keeps in several copies (a plan's index and trained values,
    1 % of every kernel of a 152 M LLM: about 100 MB), and ``tf.function``,
    having seen a variable made, traces the step a second time and keeps
    both graphs (about 10 kB per operation). Here the variables are made
    eagerly (``tf.init_scope``) and past the function's variable creator: no
    constant, one trace. Under a strategy they are made where the strategy
    makes them (its replicas).
    """
    if not tf.inside_function() or tf.distribute.has_strategy():
        return contextlib.nullcontext()
    return outside_the_trace()


def own_buffers(variables) -> None:
    """Nothing: TensorFlow variables never share a buffer after an overwrite."""


def read_elements(variable, index: np.ndarray | None) -> np.ndarray:
    """A copy of ``variable``'s elements at ``index``: gathered from the variable (``ResourceGatherNd``).

    Only those elements are read (copying the whole value to NumPy first
    cost a pass over the variable); the variable's whole reads share its
    buffer again afterwards (:func:`_sharing`).
    """
    if index is None:
        return functional.read_elements(variable, index)
    shape = tuple(int(d) for d in variable.shape)
    where = np.stack(np.unravel_index(index, shape), axis=1) if shape else np.zeros((index.size, 0), np.int64)
    raw = native(variable)
    values = tf.raw_ops.ResourceGatherNd(resource=raw.handle, indices=where, dtype=raw.dtype)
    return _sharing(raw, values).numpy()


def write_elements(variable, index: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` at ``index``: ``scatter_nd_update`` through :func:`write_all` (every replica's copy)."""
    write_all([scatter_write(variable, index, values)])


def tap(y, x, k, s, weight_gradient):
    """``y`` through a ``tf.custom_gradient`` whose backward hands ``dy`` on and gives ``s`` its gradient."""

    @tf.custom_gradient
    def tap(y, x, k, s):
        def grad(dy):
            # what the gradient makes of x and k (a transpose, a block) waits for dy: a graph's executor
            # runs an op once its inputs exist, and would make those of every layer during the forward pass
            with tf.control_dependencies([dy]):
                xb, kb = tf.identity(x), tf.identity(k)
            g = weight_gradient(xb, dy, kb)
            if isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(tf.cast(g.values, s.dtype), g.indices, g.dense_shape)
            else:
                g = tf.cast(g, s.dtype)
            return dy, None, None, g

        return tf.identity(y), grad

    return tap(y, x, k, s)


def table_elements_gradient(elements, ids, dy, flat):
    """A table's scattered trained elements' gradient as ``IndexedSlices`` over the stand-in, Keras' own form.

    An entry per id of the batch and trained element of its row, duplicates
    kept (Keras' gradient of a lookup has a row per id, and its optimizers
    take the entries one by one: Adam's second moment sums their squares).
    Each id gets ``elements.widest`` entries, those past its row's trained
    elements ``0.0`` at position 0, which adds nothing.
    """
    starts = tf.constant(elements.starts)
    first = tf.gather(starts, ids)
    count = tf.gather(starts, ids + 1) - first
    j = tf.range(elements.widest, dtype=tf.int32)[None, :]
    used = j < count[:, None]
    at = tf.where(used, first[:, None] + j, tf.zeros_like(j))  # (ids, widest): each entry's element
    column = tf.cast(tf.gather(flat, at) % elements.shape[1], tf.int32)
    values = tf.gather(dy, column, batch_dims=1)
    values = tf.where(used, values, tf.zeros_like(values))
    return tf.IndexedSlices(tf.reshape(values, (-1,)), tf.reshape(at, (-1,)), tf.constant([elements.count]))


def vjp(op, x, k, dy):
    """The gradient of ``sum(op(x, k) * dy)`` with respect to ``k``: ``tf.GradientTape``."""
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(k)
        y = op(x, k)
    return tape.gradient(y, k, output_gradients=dy)


def rows_gradient(taken, segment, dy):
    """A table's trained rows' gradient as ``IndexedSlices`` over the stand-in, duplicates kept (Keras' own form).

    Frozen elements of a row are ``0.0`` at position 0, which adds nothing.
    """
    n, width = taken.block_shape[0], taken.shape[1]
    if taken.positions is None:
        places = np.arange(n * width, dtype=np.int32).reshape(n, width)
    else:
        places = np.full(n * width, -1, np.int32)
        places[taken.positions] = np.arange(len(taken.positions), dtype=np.int32)
        places = places.reshape(n, width)
    places = np.concatenate([places, np.full((1, width), -1, np.int32)])  # the spare row: outside the block
    size = n * width if taken.positions is None else len(taken.positions)
    if not in_xla():  # keep only the entries in the block (XLA needs static shapes)
        hit = tf.reshape(tf.where(segment < n), (-1,))
        segment, dy = tf.gather(segment, hit), tf.gather(dy, hit)
    at = tf.gather(tf.constant(places), segment)  # (entries, width): each value's place, -1 frozen
    used = at >= 0
    values = tf.where(used, dy, tf.zeros_like(dy))
    at = tf.where(used, at, tf.zeros_like(at))
    return tf.IndexedSlices(tf.reshape(values, (-1,)), tf.reshape(at, (-1,)), tf.constant([size]))
