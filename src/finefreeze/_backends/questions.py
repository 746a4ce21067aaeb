"""The named questions about the environment that the rest of finefreeze asks.

Every "which backend", "is TensorFlow here" and "is this a TensorFlow object"
of the package is one of these functions, so each is answered one way:

- :func:`keras_is_tensorflow` / :func:`keras_is_jax`: the Keras backend;
- :func:`jax_has_int64`: whether JAX has 64-bit integers;
- :func:`tensorflow`: the TensorFlow module when it is the Keras backend;
- :func:`tensorflow_imported`: TensorFlow when something already imported
  it (a ``tf.Variable``, ``tf.Module`` or ``tf.data.Dataset`` cannot exist
  otherwise), never importing it;
- :func:`tensorflow_installed`: whether it could be imported, without
  importing it;
- :func:`is_variable` / :func:`is_module`: a Keras or TensorFlow variable or
  module, asked without importing TensorFlow.

A module that is blocked (``sys.modules[name] = None``, what Python's own
optional imports see when it is missing) counts as absent.

Example:
    >>> from finefreeze._backends import questions
    >>> questions.keras_backend() in ("tensorflow", "jax", "torch", "numpy", "openvino")
    True
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

__all__ = [
    "has_int64",
    "indexes_in_int64_only",
    "is_module",
    "is_variable",
    "jax_has_int64",
    "keras_backend",
    "keras_is_jax",
    "keras_is_tensorflow",
    "lookups_are_sparse",
    "tensorflow",
    "tensorflow_imported",
    "tensorflow_installed",
    "trainer_pairs_by_position",
]


def keras_backend() -> str:
    """The name of the Keras backend (imports Keras)."""
    import keras

    return keras.backend.backend()


def keras_is_tensorflow() -> bool:
    """Whether the Keras backend is TensorFlow."""
    return keras_backend() == "tensorflow"


def keras_is_jax() -> bool:
    """Whether the Keras backend is JAX."""
    return keras_backend() == "jax"


def jax_has_int64() -> bool:
    """Whether JAX runs with 64-bit integers (``jax_enable_x64``); imports JAX."""
    import jax

    return bool(jax.config.jax_enable_x64)


def has_int64() -> bool:
    """Whether the backend computes with 64-bit integers (all but JAX without ``jax_enable_x64``)."""
    return not keras_is_jax() or jax_has_int64()


def lookups_are_sparse(layer) -> bool:
    """Whether ``layer``'s variable gets a sparse gradient: an ``Embedding`` on TensorFlow (``IndexedSlices``)."""
    import keras

    return keras_is_tensorflow() and isinstance(layer, keras.layers.Embedding)


def indexes_in_int64_only() -> bool:
    """Whether the backend indexes tensors with int64 indices only (PyTorch's ``index_put_``)."""
    return keras_backend() == "torch"


def trainer_pairs_by_position() -> bool:
    """Whether Keras' trainer pairs the model's gradients with the optimizer's built-on list by position (JAX)."""
    return keras_is_jax()


def tensorflow() -> ModuleType | None:
    """The ``tensorflow`` module when it is the Keras backend, else None."""
    if not keras_is_tensorflow():
        return None
    import tensorflow as tf

    return tf


def tensorflow_imported() -> ModuleType | None:
    """``tensorflow`` if it is already imported (and not blocked), else None; never imports it."""
    return sys.modules.get("tensorflow")


def tensorflow_installed() -> bool:
    """Whether TensorFlow can be imported, without importing it."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"] is not None
    return importlib.util.find_spec("tensorflow") is not None


def is_variable(obj) -> bool:
    """Whether ``obj`` is a ``keras.Variable`` or a ``tf.Variable`` (TensorFlow is not imported for it)."""
    import keras

    if isinstance(obj, keras.Variable):
        return True
    tf = tensorflow_imported()
    return tf is not None and isinstance(obj, tf.Variable)


def is_module(obj) -> bool:
    """Whether ``obj`` is a Keras layer or a ``tf.Module`` (TensorFlow is not imported for it)."""
    import keras

    if isinstance(obj, keras.layers.Layer):
        return True
    tf = tensorflow_imported()
    return tf is not None and isinstance(obj, tf.Module)
