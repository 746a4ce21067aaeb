"""Loads ``tests/keras_backends.py`` for every run, doctests of ``src/`` included: which Keras backend runs which test."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "tests"))

pytest_plugins = ["keras_backends"]

# the sitecustomize that hides TensorFlow from the processes a run starts: never imported by the run itself
collect_ignore = ["tests/hide_tensorflow"]
