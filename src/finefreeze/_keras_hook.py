"""Register finefreeze's Keras classes when Keras loads, without importing Keras first.

``import finefreeze`` must stay light (no Keras, no TensorFlow), yet a model
file that holds a ``FreezingOptimizer`` or a layer of ``finefreeze.layers``
must load after ``import finefreeze`` alone. Keras finds such classes only in
its registry of serializable objects, so they have to be registered once
Keras is there: at once if it is already imported, else right after its
``import`` finishes (a one-shot finder on ``sys.meta_path`` wraps the loader
of the top-level ``keras`` package and removes itself).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["register_when_keras_loads", "register_now", "finish_pending"]

#: modules whose import registers every Keras class finefreeze writes into model files
_REGISTERING = ("finefreeze._optimizer.wrapper", "finefreeze.layers")
_pending = False


def _finefreeze_importing() -> bool:
    """Whether a finefreeze module (other than the package) is half-way through its import."""
    return any(
        getattr(getattr(m, "__spec__", None), "_initializing", False)
        for n, m in list(sys.modules.items())
        if n.startswith("finefreeze.")
    )


def register_now() -> None:
    """Import the registering modules (Keras is loaded); a failure warns instead of breaking Keras.

    When Keras was imported from inside a finefreeze module's own import, a
    registering module may need that half-imported module: its import then
    fails, and registration is postponed to :func:`finish_pending`, which the
    package's attribute lookup calls.
    """
    global _pending
    _pending = False
    for name in _REGISTERING:
        if name in sys.modules:
            continue  # imported, or being imported further up this very stack
        try:
            importlib.import_module(name)
        except ImportError:
            if _finefreeze_importing():
                _pending = True
                continue
            _warn(name)
        except Exception:  # never let finefreeze break `import keras`
            _warn(name)


def _warn(name: str) -> None:
    e = sys.exc_info()[1]
    warnings.warn(
        f"finefreeze could not register its Keras classes ({name}: {type(e).__name__}: {e}); "
        f"models saved with them need `import {name}` before loading.",
        RuntimeWarning,
        stacklevel=3,
    )


class _Loader(importlib.abc.Loader):
    """Runs the real loader of ``keras``, then registers finefreeze's classes."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._inner  # the module keeps its own loader (resources, reload)
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        register_now()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """A one-shot finder: on ``import keras``, wraps its loader and leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras":
            return None
        _remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def finish_pending() -> None:
    """Register now if an earlier registration was postponed and nothing of ours is half-imported."""
    if _pending:
        register_now()


def register_when_keras_loads() -> None:
    """Register now if Keras is imported, else as soon as it is (idempotent)."""
    keras = sys.modules.get("keras")
    if keras is not None:
        if getattr(getattr(keras, "__spec__", None), "_initializing", False):
            return  # Keras is importing finefreeze itself; nothing of ours is needed yet
        register_now()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
