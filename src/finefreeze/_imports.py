"""The one import mechanism of finefreeze: public names on first use, and work when a module loads.

``import finefreeze`` is light: it imports neither Keras nor TensorFlow.
Two facts follow, and this module handles both:

- A public name (``ff.Freezer``) is imported from the private module that
  defines it when it is first read (:data:`PUBLIC`, :func:`load`; the
  package's ``__getattr__``, PEP 562).
- Work that must happen when a module loads runs from one small one-shot
  finder on ``sys.meta_path`` (:func:`when_imported`): it wraps the loader of
  that top-level module and steps aside. The package registers its Keras
  classes (the optimizer, the bundled model's layer) right after ``keras``
  loads, so ``keras.models.load_model`` finds them after ``import finefreeze``
  alone; the command line imports ``tensorflow`` with its loading notices
  kept off the terminal.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable

__all__ = ["PUBLIC", "load", "when_imported", "register_keras_classes"]

#: public name -> the module that defines it ("" for a public submodule)
PUBLIC = {
    "DeltaError": "finefreeze._errors",
    "DeltaSwitch": "finefreeze._files.switch",
    "DistributionError": "finefreeze._errors",
    "FreezeWarning": "finefreeze._errors",
    "Freezer": "finefreeze._freezer.freezer",
    "FreezingOptimizer": "finefreeze._optimizer.wrapper",
    "FrozenValueChanged": "finefreeze._errors",
    "Plan": "finefreeze._plan.plan",
    "PlanError": "finefreeze._errors",
    "Rule": "finefreeze._plan.rules",
    "add_tokens": "finefreeze._hub.tokens",
    "blocks": "finefreeze._resolve.blocks",
    "callbacks": "",
    "freeze": "finefreeze._plan.rules",
    "load_delta": "finefreeze._files.delta",
    "merge_deltas": "finefreeze._files.merge",
    "select": "finefreeze._select.select",
    "tf1": "",
    "train": "finefreeze._plan.rules",
}

#: modules whose import registers every Keras class finefreeze writes into model files
_REGISTERING = ("finefreeze._optimizer.wrapper", "finefreeze._data.layers")
_pending = False


def load(name: str):
    """The public object ``name`` (imports its module; Keras classes are registered by then)."""
    where = PUBLIC[name]
    value = (
        importlib.import_module(f"finefreeze.{name}") if where == "" else getattr(importlib.import_module(where), name)
    )
    if _pending:
        register_keras_classes()
    return value


def _finefreeze_importing() -> bool:
    """Whether a finefreeze module (other than the package) is half-way through its import."""
    return any(
        getattr(getattr(m, "__spec__", None), "_initializing", False)
        for n, m in list(sys.modules.items())
        if n.startswith("finefreeze.")
    )


def register_keras_classes() -> None:
    """Import the modules that register finefreeze's Keras classes (Keras is loaded).

    When Keras was imported from inside a finefreeze module's own import, a
    registering module may need that half-imported module: registration is
    then postponed to the next :func:`load`. A failure warns; it never breaks
    ``import keras``.
    """
    global _pending
    _pending = False
    for name in _REGISTERING:
        if name in sys.modules:
            continue  # imported, or being imported further up this very stack
        try:
            importlib.import_module(name)
        except ImportError as e:
            if _finefreeze_importing():
                _pending = True
                continue
            _warn(name, e)
        except Exception as e:  # never let finefreeze break `import keras`
            _warn(name, e)


def _warn(name: str, e: BaseException) -> None:
    warnings.warn(
        f"finefreeze could not register its Keras classes ({name}: {type(e).__name__}: {e}); "
        f"models saved with them need `import {name}` before loading.",
        RuntimeWarning,
        stacklevel=3,
    )


class _Loader(importlib.abc.Loader):
    """Runs the real loader of a module inside ``around()``, then ``after()``."""

    def __init__(self, inner, around, after):
        self._inner, self._around, self._after = inner, around, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._inner  # the module keeps its own loader (resources, reload)
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        with self._around():
            self._inner.exec_module(module)
        self._after()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """A one-shot finder: on ``import <name>``, wraps its loader and leaves ``sys.meta_path``."""

    def __init__(self, name: str, around, after):
        self.name, self._around, self._after = name, around, after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, self._around, self._after)
        return spec


def when_imported(name: str, *, after: Callable[[], None] | None = None, around: Callable | None = None) -> None:
    """Run ``after()`` once the top-level module ``name`` is imported, its import inside ``around()``.

    Runs ``after()`` at once when the module is imported already (``around``
    is then moot); otherwise a one-shot finder waits for the import. Calling
    it again for a name already waited for changes nothing.
    """
    after = after or (lambda: None)
    module = sys.modules.get(name)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            after()  # a module importing finefreeze from its own import needs nothing of ours yet
        return
    if not any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, around or contextlib.nullcontext, after))
