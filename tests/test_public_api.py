"""The public namespace: flat, documented, with runnable examples."""

import inspect
import types

import keras

import finefreeze as ff


def test_all_is_flat_and_documented():
    for name in ff.__all__:
        if name == "tf1" and keras.backend.backend() != "tensorflow":
            continue  # graph code imports TensorFlow: tested on its backend
        obj = getattr(ff, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        if isinstance(obj, types.ModuleType):  # ff.callbacks: each of its names, too
            assert obj.__doc__ and obj.__all__
            for sub in obj.__all__:
                doc = inspect.getdoc(getattr(obj, sub))
                assert doc and "Example" in doc and ">>>" in doc, f"{name}.{sub} has no example"
            continue
        doc = inspect.getdoc(obj)
        assert doc, f"{name} has no docstring"
        assert "Example" in doc and ">>>" in doc, f"{name} has no example"
        assert obj.__module__.startswith("finefreeze._"), f"{name} is defined outside a private module"
