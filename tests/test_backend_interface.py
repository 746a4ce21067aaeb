"""Each backend module implements the one interface, and the one of the Keras backend in force is chosen once."""

import importlib
import inspect

import keras
import pytest

from backend_utils import BACKEND
from finefreeze._backends import functional
from finefreeze._backends.chosen import chosen

#: the backend modules this process can import (TensorFlow's imports TensorFlow: only on its backend)
MODULES = ["jax", "torch"] + (["tensorflow"] if BACKEND == "tensorflow" else [])


@pytest.mark.parametrize("name", MODULES)
def test_every_backend_module_implements_the_whole_interface_with_its_signatures(name):
    module = importlib.import_module(f"finefreeze._backends.{name}")
    for fn in functional.__all__:
        mine, base = getattr(module, fn, None), getattr(functional, fn)
        assert callable(mine), f"{name}.{fn}"
        assert len(inspect.signature(mine).parameters) == len(inspect.signature(base).parameters), f"{name}.{fn}"
    if name == BACKEND:  # select's per-example gradients: imports the framework
        assert hasattr(importlib.import_module(f"finefreeze._backends.{name}.gradients"), "Gradients")


def test_the_module_of_the_keras_backend_in_force_is_chosen_once():
    assert chosen().__name__ == f"finefreeze._backends.{keras.backend.backend()}"
    assert chosen() is chosen()
