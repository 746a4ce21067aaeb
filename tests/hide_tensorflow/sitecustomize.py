"""TensorFlow made unimportable in every Python process started with this folder on ``PYTHONPATH``.

``tests/keras_backends.py`` puts it there when ``FINEFREEZE_TESTS_WITHOUT_TENSORFLOW=1``,
so the command-line and example processes a test starts see no TensorFlow either, as
where it is not installed. Python imports ``sitecustomize`` at start-up.
"""

import importlib.machinery
import sys


class PathFinderWithoutTensorFlow(importlib.machinery.PathFinder):
    """Python's path finder, but TensorFlow is not on the path: as where it is not installed.

    ``import tensorflow`` raises ``ModuleNotFoundError``, ``importlib.util.find_spec``
    answers None and ``"tensorflow" in sys.modules`` is False, whichever way
    Keras, KerasHub and PyTorch ask (a ``None`` in ``sys.modules`` would
    answer the last one wrongly).
    """

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] == "tensorflow":
            return None
        return super().find_spec(fullname, path, target)


def hide() -> None:
    """Replace Python's path finder by one that does not find TensorFlow (idempotent)."""
    sys.meta_path[:] = [
        PathFinderWithoutTensorFlow if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]


hide()
