"""Values of variables and tensors as numpy arrays, and the backend variable behind a Keras one.

Example:
    >>> import keras, numpy as np
    >>> from finefreeze._backends.arrays import to_numpy
    >>> to_numpy(keras.Variable(np.arange(3, dtype="float32"))).tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import keras
import numpy as np

from finefreeze._backends.questions import tensorflow_imported

__all__ = ["native", "to_numpy", "unravel"]


def to_numpy(x) -> np.ndarray:
    """The value of a variable or tensor as a numpy array, on every backend."""
    if isinstance(x, keras.Variable) or keras.ops.is_tensor(x):
        return np.asarray(keras.ops.convert_to_numpy(x))
    numpy = getattr(x, "numpy", None)  # a raw tf.Variable, a value read through a session
    return np.asarray(numpy() if numpy is not None else x)


def native(v):
    """The backend variable behind a Keras variable (a raw ``tf.Variable`` stays itself)."""
    tf = tensorflow_imported()
    if tf is not None and isinstance(v, tf.Variable):
        return v
    return v.value if isinstance(v, keras.Variable) else v


def unravel(flat, shape):
    """Flat indices to ``(k, ndim)`` indices, with ``keras.ops`` that XLA compiles.

    The arithmetic runs in the dtype of ``flat``: int64 indices (variables of
    2**31 elements or more) never wrap around.
    """
    ops = keras.ops
    if len(shape) <= 1:
        return ops.expand_dims(flat, 1)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    strides.reverse()
    dtype = ops.dtype(flat)
    return ops.stack([(flat // ops.cast(s, dtype)) % ops.cast(d, dtype) for s, d in zip(strides, shape)], axis=1)
