"""TensorFlow without log lines: the commands' stderr holds only what they say.

TensorFlow's C++ logging honours ``TF_CPP_MIN_LOG_LEVEL`` once it is set up,
but the full ``tensorflow`` package (the one tensorflow-text and so KerasHub
bring) writes its notices about CUDA drivers while its libraries load,
before that: they cannot be turned off, only kept off the terminal. So the
import of TensorFlow, whenever a command first needs it (a refusal or
``--help`` never does), runs with file descriptor 2 pointed at
``/dev/null``; Python errors of that import are raised after it is put
back.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

__all__ = ["quiet_tensorflow"]


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.inner  # the module keeps its own loader (resources, reload), as _keras_hook does
        if module.__spec__ is not None:
            module.__spec__.loader = self.inner
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            self.inner.exec_module(module)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` as the path finder does, with a loader that keeps fd 2 quiet; then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _QuietFinder)]
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _QuietLoader(spec.loader)
        return spec


def quiet_tensorflow() -> None:
    """Silence TensorFlow's C++ and absl logging, and its import's notices; runs before TensorFlow is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # else a oneDNN notice is printed before logging is set up
    os.environ.setdefault("ABSL_MIN_LOG_LEVEL", "3")
    if "tensorflow" not in sys.modules and not any(isinstance(f, _QuietFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietFinder())
    try:
        import absl.logging  # light; TensorFlow's Python logging goes through it
    except ImportError:
        return
    absl.logging.set_verbosity(absl.logging.ERROR)
    absl.logging.set_stderrthreshold("error")
