"""Run a script as if TensorFlow were not installed (run by tests/test_backends.py).

    KERAS_BACKEND=jax python tests/without_tensorflow.py SCRIPT [ARGS...]
    KERAS_BACKEND=jax python tests/without_tensorflow.py -m MODULE [ARGS...]

``sys.modules["tensorflow"] = None`` is Python's own way of saying a module
is missing: every ``import tensorflow...`` raises ``ModuleNotFoundError`` and
``importlib.util.find_spec("tensorflow")`` is None, as in an environment
without it (Keras' and PyTorch's optional imports ask both ways). Then the
script (or module) runs as ``__main__``.
"""

import runpy
import sys


def main() -> None:
    sys.modules["tensorflow"] = None
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
