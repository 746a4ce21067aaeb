"""The backend interface, as JAX, PyTorch and Keras' NumPy backend share it: functional writes, dense gradients.

Every backend module (``tensorflow``, ``jax``, ``torch``) implements the
functions below; :func:`finefreeze._backends.chosen.chosen` picks one module
once, by the Keras backend in force, and the rest of finefreeze calls the
interface through ``variables``, ``elements`` and ``_slices.product``. JAX and
PyTorch take these as they are where they do not override them; Keras'
NumPy backend takes them all (it computes no gradients: nothing trains).

The interface:

- reads: :func:`snapshot`, :func:`current`, :func:`current_value`,
  :func:`as_optimizers_see`;
- gradients: :func:`is_sparse`, :func:`densify`,
  :func:`select_frozen_to_zero`, :func:`take_sparse`, :func:`spread_sparse`;
- writes: :func:`scatter_write`, :func:`block_write`, :func:`write_all`,
  :func:`eager_scope`, :func:`build_scope`, :func:`own_buffers`, :func:`read_elements`,
  :func:`write_elements`, :func:`from_host` (a variable's initial value);
- a kernel's own gradient: :func:`tap`, :func:`vjp`, :func:`rows_gradient`;
- :func:`in_xla`, :func:`prefer_in_place_updates`, :func:`nadam_product_step`,
  :func:`map_in_turn`, :func:`transposed`, :func:`sampled_dots`,
  :func:`scattered_product`;
- capabilities: :data:`SPARSE_LOOKUPS`, :data:`INT64_INDICES_ONLY`,
  :data:`PAIRS_BY_POSITION`, :func:`has_int64`;
- ``<module>.gradients.Gradients``: per-example gradients of ``select``.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np
from keras import ops

from finefreeze._backends import gathered
from finefreeze._backends.read import read

__all__ = [
    "INT64_INDICES_ONLY",
    "PAIRS_BY_POSITION",
    "SPARSE_LOOKUPS",
    "add_rows",
    "as_optimizers_see",
    "backend_variable",
    "block_write",
    "build_scope",
    "current",
    "current_value",
    "densify",
    "eager_scope",
    "from_host",
    "index_constant",
    "has_int64",
    "in_xla",
    "is_sparse",
    "map_in_turn",
    "sampled_dots",
    "scattered_product",
    "transposed",
    "nadam_product_step",
    "own_buffers",
    "prefer_in_place_updates",
    "read_elements",
    "rows_gradient",
    "scatter_write",
    "select_frozen_to_zero",
    "snapshot",
    "table_elements_gradient",
    "spread_sparse",
    "take_sparse",
    "tap",
    "vjp",
    "write_all",
    "write_elements",
]


#: an ``Embedding``'s gradient arrives sparse (TensorFlow's ``IndexedSlices``)
SPARSE_LOOKUPS = False
#: tensors are indexed with int64 indices only (PyTorch's ``index_put_``)
INT64_INDICES_ONLY = False
#: Keras' trainer pairs the model's gradients with the optimizer's built-on variables by position (JAX)
PAIRS_BY_POSITION = False


def has_int64() -> bool:
    """Whether the backend computes with 64-bit integers."""
    return True


def from_host(array: np.ndarray):
    """``array``, a host array, as a variable's initial value on this backend (as is here: Keras converts it)."""
    return array


def index_constant(index: np.ndarray):
    """``index``, a host array of indices a traced step reads as a constant: as is here (each op converts it)."""
    return index


def prefer_in_place_updates() -> bool:
    """Ask the compiler to write a variable's updated part in place, where it must be asked; True if asked now."""
    return False


def snapshot(v):
    """A tensor holding the variable's value now, unaffected by later writes (a copy)."""
    return keras.ops.copy(v.value)


def current(v):
    """The variable's value now, read to compute a value that is then written back to it (no copy)."""
    return v.value


def current_value(v):
    """The variable's value now, read densely."""
    return v.value


def as_optimizers_see(variable):
    """``variable`` as Keras hands it to an optimizer's per-variable decisions (itself)."""
    return variable


def backend_variable(variable):
    """The object a plan also knows a Keras variable by: here the variable itself.

    A backend whose Keras variable wraps a variable of its own that lives
    as long as it (TensorFlow's ``tf.Variable``, PyTorch's ``Parameter``)
    returns that one, so that a loop handing the optimizer those is
    understood. Elsewhere a variable's value is an immutable array, a new
    one after every write (JAX): held, it would keep an old value's buffer
    alive for as long as the plan.
    """
    return variable


def is_sparse(grad) -> bool:
    """Whether ``grad`` is sparse (never, here)."""
    return False


def densify(grad):
    """``grad`` as a dense tensor."""
    return keras.ops.convert_to_tensor(grad)


def select_frozen_to_zero(mask, grad):
    """``grad`` with frozen elements (``mask`` True) selected to 0 (``where``, never a product)."""
    grad = densify(grad)
    return keras.ops.where(mask, keras.ops.zeros_like(grad), grad)


def take_sparse(grad, idx, shape):
    """A sparse gradient's elements at ``idx`` (never reached: no sparse gradients here)."""
    raise TypeError(f"no sparse gradients on this backend, got {type(grad).__name__}")


def spread_sparse(standin_grad, trained: np.ndarray, shape):
    """A sparse stand-in gradient as its kernel's (never reached: no sparse gradients here)."""
    raise TypeError(f"no sparse gradients on this backend, got {type(standin_grad).__name__}")


def _scatter(var, flat_index, values):
    flat = keras.ops.reshape(var.value, (-1,))
    flat = keras.ops.scatter_update(flat, keras.ops.expand_dims(flat_index, 1), values)
    return var.assign(keras.ops.reshape(flat, var.shape))


def scatter_write(variable, flat_index, values) -> tuple:
    """A write (for :func:`write_all`) that scatters ``values`` into the flattened value at ``flat_index``."""
    return (variable, _scatter, (flat_index, values))


def _block(var, values, block=()):
    start = [s.start or 0 for s in block]
    return var.assign(ops.slice_update(var.value, start, values))


def block_write(variable, block: tuple, values) -> tuple:
    """A write (for :func:`write_all`) that updates the slice ``block`` of the value (``slice_update``)."""
    return (variable, functools.partial(_block, block=block), (values,))


def write_all(writes, after=()) -> None:
    """Perform ``[(variable, fn, args)]`` writes: a plain call of each ``fn``."""
    for var, fn, args in writes:
        fn(var, *args)


def transposed(t):
    """The transpose of a 2-D ``t``, each of its rows contiguous in memory (a gather of rows reads them whole)."""
    return keras.ops.transpose(t)


def add_rows(rows, at, count: int):
    """``out[at[e]] += rows[e]`` for each row ``e`` of the 2-D ``rows``: ``(count, rows.shape[1])``, zeros elsewhere."""
    return keras.ops.segment_sum(rows, at, num_segments=count)


def sampled_dots(x, dy, flat, columns, order: str | None, chunk: int, window=None):
    """``sum_n x[n, a] * dy[n, b]`` for each pair ``(a, b) = columns(flat)`` (a sampled product), in float32 at least.

    Here: ``gathered.gathered_dots`` with this module's :func:`transposed` and :func:`map_in_turn`.

    Args:
        x: ``(N, A)``.
        dy: ``(N, B)``.
        flat: the pairs' flat indices (int, never negative).
        columns: ``flat -> (a, b)``, the pairs' columns of ``x`` and of ``dy``, for any part of ``flat``
            (written in ``keras.ops``: a backend may hand it an unsigned copy of ``flat``).
        order: ``"a"``: the pairs are sorted by ``a``, then ``b``; ``"b"``: by ``b``, then ``a``; None: neither.
        chunk: the most values of ``x`` (and of ``dy``) gathered at once.
        window: ``per -> int | None``: how many columns of the sorted side (``order``) the pairs of a
            chunk of ``per`` pairs span at most, or None (not known, or not fewer than the side's own):
            each chunk then transposes those columns alone (see ``gathered.gathered_dots``).

    Returns:
        The pairs' sums, float32 (float64 for float64 inputs).
    """
    return gathered.gathered_dots(x, dy, flat, columns, chunk, transposed, map_in_turn, order=order, window=window)


def scattered_product(t, values, take_at, add_at, width: int, chunk: int):
    """``out[n, add_at[e]] += t[n, take_at[e]] * values[e]`` for distinct pairs ``e``: ``(N, width)``.

    ``t`` (``(N, A)``) times the ``(A, width)`` matrix that is zero but
    ``values`` at the pairs, read at the pairs alone: no value of the
    matrix's shape. Here: ``gathered.spread`` with this module's
    :func:`transposed` and :func:`add_rows`, ``chunk`` gathered values at a time.
    """
    return gathered.spread(t, values, take_at, add_at, width, chunk, transposed, add_rows)


def map_in_turn(fn, xs, dtype: str):
    """``fn`` over the first axis of ``xs``, one slice after another (``keras.ops.map``): ``fn``'s results are ``dtype``.

    Bounds the memory of a loop over chunks to one chunk's.
    """
    return keras.ops.map(fn, xs)


def eager_scope():
    """A context where variable values can be read eagerly (any context, here)."""
    return contextlib.nullcontext()


def build_scope():
    """A context where a build makes its variables and their initial values (any context, here)."""
    return contextlib.nullcontext()


def own_buffers(variables) -> None:
    """Give each variable a buffer of its own after an overwrite that may have shared one (EMA's)."""
    for v in variables:
        v.assign(ops.copy(v.value))


def read_elements(variable, index: np.ndarray | None) -> np.ndarray:
    """A copy of ``variable``'s elements at the flat indices ``index`` (None: the whole value)."""
    value = read(variable)
    if index is None:
        return np.array(value, copy=True)
    return np.ascontiguousarray(value.reshape(-1)[index])


def write_elements(variable, index: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` at the flat indices ``index`` of ``variable`` (a NumPy scatter, assigned)."""
    flat = np.array(read(variable), copy=True).reshape(-1)
    flat[index] = values
    variable.assign(flat.reshape(tuple(variable.shape)))


def tap(y, x, k, s, weight_gradient):
    """``y`` passed on, with ``weight_gradient(x, dy, k)`` the gradient of stand-in ``s`` (no gradients here)."""
    return y


def vjp(op, x, k, dy):
    """The gradient of ``sum(op(x, k) * dy)`` with respect to ``k`` (no gradients here)."""
    raise TypeError("this Keras backend computes no gradients")


def rows_gradient(taken, segment, dy):
    """A table's trained rows' gradient: ``dy`` summed per row of the block (``segment``: each entry's row)."""
    n = taken.block_shape[0]
    return taken.trained(ops.segment_sum(dy, segment, num_segments=n + 1)[:n])


def table_elements_gradient(elements, ids, dy, flat):
    """A table's scattered trained elements' gradient: ``dy`` summed per distinct id, each element reading its own.

    ``ids``: the batch's ids, counted from the start; ``dy``: ``(len(ids),
    width)``; ``flat``: the elements' padded flat indices (the repeats past
    ``elements.count`` dropped). Elements whose row is not in the batch get
    ``0``.
    """
    width = elements.shape[1]
    n = ids.shape[0] if ids.shape[0] is not None else ops.shape(ids)[0]
    order = ops.argsort(ids)
    ids, dy = ops.take(ids, order, axis=0), ops.take(dy, order, axis=0)  # the entries by id
    first = ops.concatenate([ops.ones((1,), "bool"), ops.not_equal(ids[1:], ids[:-1])])
    slot = ops.subtract(ops.cumsum(ops.cast(first, "int32")), 1)  # each entry's distinct id's place
    sums = ops.reshape(ops.segment_sum(dy, slot, num_segments=n), (-1,))
    row = ops.cast(ops.floor_divide(flat, width), "int32")
    column = ops.cast(ops.mod(flat, width), "int32")
    at = ops.cast(ops.minimum(ops.searchsorted(ids, row, side="left"), n - 1), "int32")  # the row's first entry
    value = ops.take(sums, ops.add(ops.multiply(ops.take(slot, at, axis=0), width), column), axis=0)
    out = ops.where(ops.equal(ops.take(ids, at, axis=0), row), value, ops.zeros_like(value))
    return out if int(out.shape[0]) == elements.count else out[: elements.count]


def in_xla() -> bool:
    """Whether the graph being built compiles with XLA (TensorFlow's question; never, here)."""
    return False


def nadam_product_step(product, beta_1, factor):
    """Nadam's running product moved on by one step, in the order Keras' own Nadam takes it."""
    return product * beta_1 * factor
