"""Read and write some elements of a variable in place, outside any train step (deltas in and out).

- TensorFlow: ``scatter_nd_update`` on the variable's resource (through
  :func:`~finefreeze._backends.variables.write_all`, so a distributed
  variable's every copy is written).
- JAX: a jitted scatter that donates the variable's buffer, so XLA writes
  the elements into it (no second copy of the variable; the same donation
  Keras' own train step makes); its inputs padded to a few lengths, so
  that kernels of one shape share a compiled program.
- PyTorch: ``index_put_`` into the flattened value under ``no_grad`` (int64
  indices, taken as they are; reads index the value the same way).

A whole variable (``index`` None) is assigned. Reads gather the elements
into a new numpy array (:func:`~finefreeze._backends.read.read` views the
buffer: no copy of the variable).
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from finefreeze._backends.arrays import native
from finefreeze._backends.questions import keras_backend, tensorflow
from finefreeze._backends.read import read
from finefreeze._backends.variables import scatter_write, write_all

__all__ = ["read_elements", "write_elements"]


def read_elements(variable, index: np.ndarray | None) -> np.ndarray:
    """A copy of ``variable``'s elements at the flat indices ``index`` (None: the whole value).

    TensorFlow gathers from a dense read of the variable (which shares its
    buffer and is gone before the next write, so that write stays in place;
    copying the whole value to NumPy first cost a pass over the variable).
    """
    tf = tensorflow()
    if index is not None and tf is not None:
        shape = tuple(int(d) for d in variable.shape)
        where = np.stack(np.unravel_index(index, shape), axis=1) if shape else np.zeros((index.size, 0), np.int64)
        return tf.raw_ops.ResourceGatherNd(
            resource=native(variable).handle, indices=where, dtype=native(variable).dtype
        ).numpy()
    if index is not None and keras_backend() == "torch" and index.dtype == np.int64 and variable.value.is_contiguous():
        import torch

        with torch.no_grad():
            return keras.ops.convert_to_numpy(variable.value.view(-1)[torch.from_numpy(index)])
    value = read(variable)
    if index is None:
        return np.array(value, copy=True)
    return np.ascontiguousarray(value.reshape(-1)[index])


@functools.cache
def _jax_scatter():
    import jax

    def scatter(value, index, values):
        return value.reshape(-1).at[index].set(values).reshape(value.shape)

    return jax.jit(scatter, donate_argnums=0)


def _padded(index: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``index`` and ``values`` padded (the last element written again) to one of 8 lengths per power of two.

    XLA compiles the scatter once per shape: kernels of one shape whose
    trained counts differ a little (a random 1 % of each) share one program
    instead of one each (JAX's compiled programs are memory the process keeps).
    Padding adds at most 1/8 to the writes; an element written twice gets the same value.
    """
    n = int(index.size)
    if n < 16:
        return index, values
    step = 1 << (n.bit_length() - 4)
    m = -(-n // step) * step
    if m == n:
        return index, values
    return np.concatenate([index, np.repeat(index[-1:], m - n)]), np.concatenate(
        [values, np.repeat(values[-1:], m - n)]
    )


def write_elements(variable, index: np.ndarray | None, values: np.ndarray) -> None:
    """Write ``values`` at the flat indices ``index`` of ``variable`` in place (None: assign the whole value)."""
    if index is None:
        variable.assign(values)
        return
    backend = keras_backend()
    if tensorflow() is not None:
        write_all([scatter_write(variable, index, values)])
    elif backend == "jax":
        variable.assign(_jax_scatter()(variable.value, *_padded(np.asarray(index), np.asarray(values))))
    elif backend == "torch":
        import torch

        value = variable.value
        if not value.is_contiguous():
            variable.assign(_numpy_scatter(variable, index, values))
            return
        with torch.no_grad():
            flat = value.view(-1)
            where = torch.from_numpy(index) if index.dtype == np.int64 else torch.as_tensor(index).long()
            new = keras.ops.convert_to_tensor(values, dtype=variable.dtype)  # NumPy has no bfloat16 of torch's
            flat.index_put_((where.to(flat.device),), new.to(device=flat.device, dtype=flat.dtype))
    else:
        variable.assign(_numpy_scatter(variable, index, values))


def _numpy_scatter(variable, index, values) -> np.ndarray:
    flat = np.array(read(variable), copy=True).reshape(-1)
    flat[index] = values
    return flat.reshape(tuple(variable.shape))
