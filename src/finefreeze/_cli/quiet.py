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

import contextlib
import os
import sys

from finefreeze._imports import when_imported

__all__ = ["quiet_tensorflow"]


@contextlib.contextmanager
def _stderr_closed():
    """File descriptor 2 pointed at ``/dev/null`` (Python errors are raised after it is put back)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quiet_tensorflow() -> None:
    """Silence TensorFlow's C++ and absl logging, and its import's notices; runs before TensorFlow is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # else a oneDNN notice is printed before logging is set up
    os.environ.setdefault("ABSL_MIN_LOG_LEVEL", "3")
    when_imported("tensorflow", around=_stderr_closed)
    try:
        import absl.logging  # light; TensorFlow's Python logging goes through it
    except ImportError:
        return
    absl.logging.set_verbosity(absl.logging.ERROR)
    absl.logging.set_stderrthreshold("error")
