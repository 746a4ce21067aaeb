"""Variable operations the strategies use, written once; what differs per backend is the chosen module's.

Strategies are written with ``keras.ops``. Reads, sparse gradients and
writes differ between backends: each function here calls the module
:func:`~finefreeze._backends.chosen.chosen` picked once (``tensorflow``,
``jax``, ``torch``; their interface is documented in ``functional``):

- TensorFlow: writes under ``tf.distribute`` go through ``merge_call`` and
  ``extended.update`` (every replica's copy); sparse ``IndexedSlices``
  gradients (embeddings) stay sparse; compact results are scattered in place
  with ``scatter_nd_update``; a build traced inside ``tf.function`` reads
  values under ``tf.init_scope``.
- JAX and PyTorch: plain ``variable.assign`` (inside JAX's stateless, jitted
  train step the assignments are recorded by Keras' StatelessScope); compact
  results are written with a functional ``scatter_update`` into the flattened
  value (eager PyTorch writes the elements in place, as Keras' own ``assign``
  writes its value); a JAX snapshot is the (immutable) value itself.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
from keras import ops

from finefreeze._backends import jax as jax_backend
from finefreeze._backends.arrays import unravel
from finefreeze._backends.chosen import chosen
from finefreeze._backends.jax import IN_PLACE_FLAG
from finefreeze._backends.questions import keras_backend

__all__ = [
    "IN_PLACE_FLAG",
    "as_optimizers_see",
    "assign",
    "backend_variable",
    "block_write",
    "build_scope",
    "current",
    "current_value",
    "eager_scope",
    "flat_dense",
    "host_constant",
    "host_initializer",
    "in_xla",
    "is_sparse",
    "own_buffers",
    "prefer_in_place_updates",
    "read_block",
    "scatter_write",
    "select_frozen_to_zero",
    "snapshot",
    "take_block",
    "take_trainable",
    "take_values",
    "unravel",
    "write_all",
]


def prefer_in_place_updates() -> bool:
    """Ask the compiler to write a variable's updated part in place (JAX on a CPU, before it starts); True if asked."""
    return chosen().prefer_in_place_updates()


if keras_backend() == "jax":  # at import, before JAX starts: the chosen module may be imported later than that
    jax_backend.prefer_in_place_updates()


def snapshot(v):
    """A tensor holding the variable's value now, unaffected by later writes (JAX: the immutable value itself)."""
    return chosen().snapshot(v)


def current(v):
    """The variable's value now, read to compute a value that is then written back to it (no copy off TensorFlow)."""
    return chosen().current(v)


def current_value(v):
    """The variable's value now, read densely (TensorFlow: one read op, sharing the variable's buffer)."""
    return chosen().current_value(v)


def as_optimizers_see(variable):
    """``variable`` as Keras hands it to an optimizer's per-variable decisions (TensorFlow: its ``tf.Variable``)."""
    return chosen().as_optimizers_see(variable)


def backend_variable(variable):
    """The object a plan also knows a Keras variable by: TensorFlow's ``tf.Variable``, PyTorch's ``Parameter``, else itself."""
    return chosen().backend_variable(variable)


def is_sparse(grad) -> bool:
    """Whether ``grad`` is sparse: TensorFlow's ``IndexedSlices``, or a PyTorch sparse tensor (sliced embeddings)."""
    return chosen().is_sparse(grad)


def select_frozen_to_zero(mask, grad):
    """``grad`` with frozen elements (``mask`` True) selected to 0 (``where``, never a product)."""
    return chosen().select_frozen_to_zero(mask, grad)


def in_xla() -> bool:
    """Whether the graph being built compiles with XLA (TensorFlow's ``jit_compile=True``): shapes must be static."""
    return chosen().in_xla()


def take_values(v, idx):
    """The variable's values now at the flat indices ``idx``: a gather from its value, a new tensor.

    A dense read shares the variable's buffer (no copy); TensorFlow's sparse
    reads (``ResourceGatherNd``) would switch the variable to copying at
    every dense read, the step's forward pass included.
    """
    return ops.take(ops.reshape(current_value(v), (-1,)), idx, axis=0)


def take_trainable(grad, idx, shape):
    """The gradient of a compact vector: ``grad`` at the sorted flat indices ``idx`` of a variable of ``shape``.

    A dense gradient is flattened and gathered. A sparse one (a TensorFlow
    embedding's ``IndexedSlices``, a PyTorch sparse tensor of rows) stays
    sparse and is never densified: the backend finds the entries of the
    trained elements (``take_sparse``), so the inner optimizer's sparse
    update of the vector equals its update of those elements in the whole
    table, bit for bit, at the cost of the batch's rows rather than of the
    table.
    """
    if not is_sparse(grad):
        return ops.take(flat_dense(grad), idx, axis=0)
    return chosen().take_sparse(grad, idx, shape)


def flat_dense(grad):
    """``grad`` as a dense flat tensor (a sparse one is densified)."""
    return keras.ops.reshape(chosen().densify(grad), (-1,))


def assign(var, value):
    return var.assign(value)


def read_block(v, block: tuple, idx):
    """The elements of ``v`` in the block ``block`` (flat, C order); ``idx``: their flat indices.

    A slice of the value, read densely (:func:`current_value`): the read is
    done before the block's write, which then writes in place.
    """
    return take_block(current_value(v), block)


def take_block(t, block: tuple):
    """``t[block]`` flattened: the elements of a block of ranges (a tuple of slices), in C order."""
    return ops.reshape(ops.convert_to_tensor(t)[block], (-1,))


def block_write(variable, block: tuple, values) -> tuple:
    """A write (for :func:`write_all`) that puts ``values`` (flat, C order) into the block ``block`` of ``variable``.

    TensorFlow assigns the block's slice in place
    (``ResourceStridedSliceAssign``); JAX and PyTorch update the slice of the
    value (``slice_update``; eager PyTorch writes it in place).
    """
    shape = tuple(s.stop - (s.start or 0) for s in block)
    return chosen().block_write(variable, block, ops.reshape(values, shape))


def scatter_write(variable, flat_index, values) -> tuple:
    """A write (for :func:`write_all`) that puts ``values`` at the flat indices ``flat_index`` of ``variable``.

    TensorFlow scatters in place into the variable (``scatter_nd_update`` with
    ``(k, ndim)`` indices); JAX and PyTorch scatter into the flattened value,
    which needs no index arithmetic (XLA updates a donated buffer in place).
    """
    return chosen().scatter_write(variable, flat_index, values)


def write_all(writes, after=()) -> None:
    """Perform ``[(variable, fn, args)]`` writes through the backend's update path.

    Under ``tf.distribute`` a write from replica context goes through
    ``merge_call`` and ``extended.update`` (every replica's copy). ``after``:
    tensors (the step's gradients) a TensorFlow graph computes before the
    writes, so that the writes are in place. Elsewhere a plain call of each ``fn``.
    """
    chosen().write_all(writes, after)


def eager_scope():
    """A context where variable values can be read eagerly, even while TensorFlow traces a function."""
    return chosen().eager_scope()


def build_scope():
    """A context where a build makes its variables eagerly, also while TensorFlow traces a function."""
    return chosen().build_scope()


def own_buffers(variables) -> None:
    """Give each variable a buffer of its own after an overwrite that may have shared one (off TensorFlow).

    The EMA overwrite (``finalize_variable_values``) makes each variable share
    its buffer with its average; JAX's next train step donates both and fails
    (plain Keras 3.15 too).
    """
    chosen().own_buffers(variables)


def host_initializer(value) -> Callable:
    """A Keras initializer that gives ``value`` (reshaped, cast to the variable's dtype on the host) and compiles nothing.

    A host array handed to Keras as a variable's value, and Keras' ``zeros``
    initializer, compile a program per shape on JAX, which the process
    keeps (``from_host`` in ``finefreeze._backends.jax``); the variables a
    plan makes have a shape per partially trained kernel.

    Args:
        value: an array, or a scalar (broadcast to the variable's shape).

    Returns:
        ``init(shape, dtype=None)``, as Keras calls an initializer.
    """
    value = np.asarray(value)

    def init(shape, dtype=None):
        shape = tuple(int(d) for d in shape)
        out = np.broadcast_to(value, shape) if value.ndim == 0 else value.reshape(shape)
        out = np.array(out, dtype=_numpy_dtype(dtype) if dtype is not None else out.dtype)  # contiguous, owned
        return chosen().from_host(out)

    return init


def host_constant(initializer):
    """``initializer`` (as ``add_variable`` takes it) as a :func:`host_initializer` where it is a constant.

    Keras' ``zeros``, ``ones`` and ``Constant(value)`` give the same values
    made on the host; any other initializer is returned as it is.
    """
    init = keras.initializers.get(initializer)
    if type(init) is keras.initializers.Zeros:
        return host_initializer(0)
    if type(init) is keras.initializers.Ones:
        return host_initializer(1)
    if type(init) is keras.initializers.Constant and np.ndim(init.value) == 0:
        return host_initializer(init.value)
    return initializer


def _numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a Keras dtype (``bfloat16`` and the float8 types from ``ml_dtypes``, as Keras' own)."""
    name = keras.backend.standardize_dtype(dtype)
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
