"""The backend module of the Keras backend in force, chosen once.

Like Keras' own ``keras/src/backend/__init__.py``, which imports one backend
package, finefreeze asks which backend runs once (:func:`chosen`) and from
then on calls that module's functions: ``tensorflow``, ``jax`` or ``torch``
(each implements the interface ``functional`` documents), or ``functional``
itself for Keras' NumPy backend. Only the chosen framework is imported.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from finefreeze._backends.questions import keras_backend

__all__ = ["chosen"]

_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


@functools.cache
def chosen() -> ModuleType:
    """The module implementing the backend interface for the Keras backend in force (imported once)."""
    return importlib.import_module(f"finefreeze._backends.{_MODULES.get(keras_backend(), 'functional')}")
