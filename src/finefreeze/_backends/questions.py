"""The named questions about the environment, each answered one way.

"Which Keras backend" is asked inside ``_backends`` only (the chosen module
answers the rest: ``chosen``); "is TensorFlow here" and "is this a
TensorFlow object" anywhere:

- :func:`keras_backend` / :func:`keras_is_tensorflow`: the Keras backend (``_backends`` only);
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
    "backend_record",
    "is_module",
    "is_variable",
    "keras_backend",
    "keras_is_tensorflow",
    "tensorflow",
    "tensorflow_imported",
    "tensorflow_installed",
]


def keras_backend() -> str:
    """The name of the Keras backend (imports Keras)."""
    import keras

    return keras.backend.backend()


def backend_record() -> str:
    """The Keras backend's name, for a record a later run compares with its own (a resume point's settings).

    Never to branch on: what differs between backends lives in ``_backends``.
    """
    return keras_backend()


def keras_is_tensorflow() -> bool:
    """Whether the Keras backend is TensorFlow."""
    return keras_backend() == "tensorflow"


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
