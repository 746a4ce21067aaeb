"""Which Keras backend runs which test: a pytest plugin (the root ``conftest.py`` loads it).

Every test runs on every Keras backend (the one ``KERAS_BACKEND`` names)
unless the test itself says otherwise, with a reason::

    pytestmark = pytest.mark.backends("tensorflow", reason="tf.distribute")   # a whole file
    @pytest.mark.backends("jax", reason="XLA's host devices")                 # one test

- A file marked for other backends is not even imported on this one (its
  marker is read from its source), so a TensorFlow-only file may import
  TensorFlow at its top. A test marked for other backends is deselected.
- A source module (doctests) that imports a framework (TensorFlow, JAX,
  PyTorch) at its top belongs to that framework's backend by that import.
- A marker that names no backend, an unknown one or no reason, and a test
  file that imports a framework at its top without saying it runs on that
  backend only, are collection errors: no test can silently run nowhere.
- ``FINEFREEZE_TESTS_WITHOUT_TENSORFLOW=1`` makes TensorFlow unimportable in
  this process, its xdist workers and the children they start, as where it
  is not installed (Keras and PyTorch then take their TensorFlow-less paths).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib

import pytest

HIDE = "FINEFREEZE_TESTS_WITHOUT_TENSORFLOW"


if os.environ.get(HIDE) == "1":  # here, and in every process started from here (their sitecustomize)
    _HIDING = pathlib.Path(__file__).resolve().parent / "hide_tensorflow"
    _spec = importlib.util.spec_from_file_location("_hide_tensorflow", _HIDING / "sitecustomize.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(_HIDING)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402

ALL = ("tensorflow", "jax", "torch")
BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parent.parent


class Markers:
    """What one file says of its backends, read from its source without importing it."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

    def backends(self) -> tuple[str, ...] | None:
        """The backends of a module-level ``pytestmark = pytest.mark.backends(...)``; None: every backend."""
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                marks = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
                for mark in marks:
                    if _is_backends_mark(mark):
                        names = tuple(a.value for a in mark.args if isinstance(a, ast.Constant))
                        check(names, _reason_of(mark), str(self.path.relative_to(ROOT)))
                        return names
        return None

    def frameworks(self) -> tuple[str, ...]:
        """The backends' frameworks the module imports at its top (outside functions and ``if`` blocks)."""
        names = set()
        top = [*self.tree.body, *(n for t in self.tree.body if isinstance(t, ast.Try) for n in t.body)]
        for node in top:  # a top-level try that imports it, to say how to install it, counts too
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add((node.module or "").split(".")[0])
        return tuple(b for b in ALL if b in names)

    def imports_tensorflow(self) -> bool:
        """Whether the module imports TensorFlow at its top."""
        return "tensorflow" in self.frameworks()


def _is_backends_mark(node) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "backends" and ast.unparse(f.value) == "pytest.mark"


def _reason_of(node) -> str | None:
    for k in node.keywords:
        if k.arg == "reason" and isinstance(k.value, ast.Constant):
            return k.value.value
    return None


def check(names, reason, where: str) -> None:
    """Refuse a ``backends`` marker that would leave a test to no backend, or give no reason.

    Raises:
        pytest.UsageError: names the test or file and the rule it breaks.
    """
    if not names:
        raise pytest.UsageError(f"{where}: pytest.mark.backends() names no backend: no run would ever run it")
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise pytest.UsageError(f"{where}: pytest.mark.backends names {unknown}; the Keras backends are {list(ALL)}")
    if not reason:
        raise pytest.UsageError(f"{where}: pytest.mark.backends{tuple(names)} needs reason=: why the others cannot")


def _file_backends(path: pathlib.Path) -> tuple[str, ...] | None:
    """The backends a file runs on (None: all), checking what it says; cached per path."""
    cache = _file_backends.__dict__.setdefault("cache", {})
    if path not in cache:
        m = Markers(path)
        names = m.backends()
        rel = str(path.relative_to(ROOT))
        frameworks = m.frameworks()
        if frameworks:
            if path.name.startswith("test_") and (names is None or set(names) - set(frameworks)):
                raise pytest.UsageError(
                    f"{rel} imports {' and '.join(frameworks)} at its top but does not say it runs on that "
                    f'backend only: mark it `pytestmark = pytest.mark.backends("{frameworks[0]}", reason=...)`, '
                    "or import the framework inside the tests that need it and mark those"
                )
            names = names if names is not None else frameworks  # a source module: its doctests need it
        cache[path] = names
    return cache[path]


def _test_files(config) -> list[pathlib.Path]:
    return sorted((ROOT / "tests").glob("test_*.py"))


def pytest_configure(config):
    for path in _test_files(config):  # every file checked on every run, whichever backend runs it
        _file_backends(path)
    if BACKEND == "jax" and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _share_jax_cache(config)


def _share_jax_cache(config) -> None:
    """One XLA compilation cache for the whole run, its xdist workers included (made by the first process).

    Every test builds its own model, so the same programs compile again and
    again. The cache's eviction (a size limit) makes JAX take a file lock for
    every read and write, so no worker reads a program another is writing.
    """
    import atexit
    import shutil
    import tempfile

    import jax

    folder = tempfile.mkdtemp(prefix="finefreeze-jax-compiled-")
    atexit.register(shutil.rmtree, folder, True)
    settings = {
        "jax_compilation_cache_dir": folder,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
        "jax_compilation_cache_max_size": 4 << 30,  # a limit turns the file lock on
    }
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)  # the workers xdist starts read them when they import JAX
        jax.config.update(name, value)  # this process imported JAX already


def pytest_ignore_collect(collection_path, config):
    path = pathlib.Path(collection_path)
    if path.suffix != ".py" or not path.is_file():
        return None
    try:
        path.relative_to(ROOT)
    except ValueError:
        return None
    names = _file_backends(path)
    if names is not None and BACKEND not in names:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("backends")
        if mark is not None:
            check(mark.args, mark.kwargs.get("reason"), item.nodeid)
        (keep if mark is None or BACKEND in mark.args else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    other = [
        p.name for p in _test_files(config) if (_file_backends(p) or ALL) and BACKEND not in (_file_backends(p) or ALL)
    ]
    hidden = " (TensorFlow made unimportable)" if os.environ.get(HIDE) == "1" else ""
    lines = [f"Keras backend: {BACKEND}{hidden}"]
    if other:
        lines.append(f"test files for other Keras backends only, not collected: {', '.join(other)}")
    return lines
