"""The backend module of the Keras backend in force, chosen once.

Like Keras' own ``keras/src/backend/__init__.py``, which imports one backend
package, finefreeze asks which backend runs once (:func:`chosen`) and from
then on calls that module's functions: ``tensorflow``, ``jax`` or ``torch``
(each implements the interface ``functional`` documents), or ``functional``
itself for Keras' NumPy backend. Only the chosen framework is imported.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from finefreeze._backends.questions import keras_backend

__all__ = ["chosen", "has_int64", "indexes_in_int64_only", "lookups_are_sparse", "trainer_pairs_by_position"]

_MODULES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


_CHOSEN: list[ModuleType] = []  # the module, once imported


def chosen() -> ModuleType:
    """The module implementing the backend interface for the Keras backend in force (imported once).

    Held in a module-level list rather than behind ``functools.cache``:
    ``torch.compile`` traces through a cache's wrapper into the import
    (which it does not trace, so every call split the compiled step),
    while a list it reads and guards like any other global.
    """
    if not _CHOSEN:
        _CHOSEN.append(importlib.import_module(f"finefreeze._backends.{_MODULES.get(keras_backend(), 'functional')}"))
    return _CHOSEN[0]


def has_int64() -> bool:
    """Whether the backend computes with 64-bit integers (all but JAX without ``jax_enable_x64``)."""
    return chosen().has_int64()


def lookups_are_sparse(layer) -> bool:
    """Whether ``layer``'s variable gets a sparse gradient (an ``Embedding`` whose backend's lookups are sparse)."""
    import keras

    return chosen().SPARSE_LOOKUPS and isinstance(layer, keras.layers.Embedding)


def indexes_in_int64_only() -> bool:
    """Whether the backend indexes tensors with int64 indices only (PyTorch's ``index_put_``)."""
    return chosen().INT64_INDICES_ONLY


def trainer_pairs_by_position() -> bool:
    """Whether Keras' trainer pairs the model's gradients with the optimizer's built-on list by position (JAX)."""
    return chosen().PAIRS_BY_POSITION
