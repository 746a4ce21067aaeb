"""Each backend module implements the one interface, and the one of the Keras backend in force is chosen once."""

import importlib
import inspect
import pathlib

import keras
import numpy as np
import pytest

from backend_utils import BACKEND
from finefreeze._backends import functional
from finefreeze._backends.chosen import chosen

#: every backend package under ``_backends``; TensorFlow's imports TensorFlow at its top: only on its backend
PACKAGES = sorted(p.parent.name for p in pathlib.Path(functional.__file__).parent.glob("*/__init__.py"))
MODULES = [name for name in PACKAGES if name != "tensorflow" or BACKEND == "tensorflow"]


def test_the_three_backends_have_a_package():
    assert {"tensorflow", "jax", "torch"} <= set(PACKAGES)


@pytest.mark.parametrize("name", MODULES)
def test_every_backend_module_implements_the_whole_interface_with_its_signatures(name):
    module = importlib.import_module(f"finefreeze._backends.{name}")
    assert set(functional.__all__) <= set(module.__all__), name
    for fn in functional.__all__:
        mine, base = getattr(module, fn, None), getattr(functional, fn)
        if not callable(base):  # a capability: a flag of the same type
            assert type(mine) is type(base), f"{name}.{fn}"
            continue
        assert callable(mine), f"{name}.{fn}"
        assert len(inspect.signature(mine).parameters) == len(inspect.signature(base).parameters), f"{name}.{fn}"
    if name == BACKEND:  # select's per-example gradients: imports the framework
        assert hasattr(importlib.import_module(f"finefreeze._backends.{name}.gradients"), "Gradients")


def test_the_module_of_the_keras_backend_in_force_is_chosen_once():
    assert chosen().__name__ == f"finefreeze._backends.{keras.backend.backend()}"
    assert chosen() is chosen()


def test_transposed_gives_the_transpose_with_each_row_whole_in_memory():
    """The sampled product gathers rows of it: on PyTorch ``.T`` alone is a strided view, read at a tenth of the speed."""
    import numpy as np

    x = np.arange(24, dtype="float32").reshape(6, 4)
    got = chosen().transposed(keras.ops.convert_to_tensor(x))
    assert np.array_equal(keras.ops.convert_to_numpy(got), x.T)
    if BACKEND == "torch":
        assert got.is_contiguous()


@pytest.mark.parametrize("windowed", [False, True], ids=["whole", "windows"])
@pytest.mark.parametrize("order", ["a", "b", None])
def test_sampled_dots_give_each_pairs_dot_product_in_the_pairs_order(order, windowed):
    """``sum_n x[n, a] * dy[n, b]`` per pair, for pairs sorted by ``a``, by ``b`` or neither, at the product's bound.

    The pairs come as flat indices and the function that gives their columns (any part of them: the
    gathers compute each chunk's in its turn). (PyTorch's is a sampled sparse product: its pattern's rows
    are ``a``, ``b`` or the pairs sorted first.) ``windows``: each chunk of pairs is said to span at
    most so many columns of the sorted side, which the gathers then cut out alone.
    """
    import numpy as np

    rng = np.random.default_rng(3)
    x, dy = rng.normal(size=(40, 9)).astype("float32"), rng.normal(size=(40, 13)).astype("float32")
    a, b = rng.integers(0, 9, size=60), rng.integers(0, 13, size=60)
    if order is not None:
        key = a * 13 + b if order == "a" else b * 9 + a
        _, first = np.unique(key, return_index=True)  # distinct pairs, sorted by the key
        a, b = a[first], b[first]
    flat = b * 9 + a if order == "b" else a * 13 + b

    def columns(part):
        return (part % 9, part // 9) if order == "b" else (part // 13, part % 13)

    def window(per):
        padded = np.concatenate([flat, np.repeat(flat[-1:], -flat.size % per)]).reshape(-1, per)
        side = columns(padded)[0 if order == "a" else 1]
        return int((side[:, -1] - side[:, 0]).max()) + 1

    if windowed and order is not None:  # narrow enough for the gathers to take it: the pairs of a few columns
        keep = np.flatnonzero((a < 4) if order == "a" else (b < 6))
        keep = keep[: keep.size // 4 * 4]  # chunks of 4 pairs, each cutting a window of 2 columns or more
        a, b, flat = a[keep], b[keep], flat[keep]
        assert 2 <= window(4) <= (4 if order == "a" else 6) and flat.size >= 12
    got = chosen().sampled_dots(
        keras.ops.convert_to_tensor(x),
        keras.ops.convert_to_tensor(dy),
        keras.ops.convert_to_tensor(flat.astype("int32")),
        columns,
        order,
        40 * 4,  # 4 pairs a chunk where the product gathers: x and dy hold more than two chunks' values
        window if windowed else None,
    )
    got = keras.ops.convert_to_numpy(got)
    reference = np.einsum("nk,nk->k", x[:, a].astype("float64"), dy[:, b].astype("float64"))
    assert got.dtype == np.float32 and got.shape == (a.size,)
    assert np.max(np.abs(got - reference)) <= 1e-5 * np.max(np.abs(reference))


def test_add_rows_adds_each_row_at_its_place():
    rows = np.arange(12, dtype="float32").reshape(4, 3)
    at = np.array([2, 0, 2, 4], "int32")
    want = np.zeros((5, 3), "float32")
    np.add.at(want, at, rows)
    got = keras.ops.convert_to_numpy(
        chosen().add_rows(keras.ops.convert_to_tensor(rows), keras.ops.convert_to_tensor(at), 5)
    )
    assert np.array_equal(got, want)


@pytest.mark.parametrize("chunk", [1 << 21, 16])  # 16 values: two pairs at a time, in a loop (where gathered)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # a mixed-precision layer's input
def test_scattered_product_multiplies_by_the_matrix_that_is_zero_but_at_the_pairs(chunk, dtype):
    rng = np.random.default_rng(8)
    t = rng.normal(size=(8, 10)).astype("float32")
    pairs = rng.choice(60, 25, replace=False)  # in no order: an input's gradient reads them so
    take, add = (pairs // 6).astype("int32"), (pairs % 6).astype("int32")
    values = rng.normal(size=25).astype("float32")
    ts = keras.ops.cast(keras.ops.convert_to_tensor(t), dtype)
    t = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(ts, "float32")))  # the values the product reads
    matrix = np.zeros((10, 6))
    matrix[take, add] = values
    got = chosen().scattered_product(ts, *(keras.ops.convert_to_tensor(a) for a in (values, take, add)), 6, chunk)
    assert tuple(got.shape) == (8, 6) and keras.backend.standardize_dtype(got.dtype) == dtype
    got = keras.ops.convert_to_numpy(keras.ops.cast(got, "float32"))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=0.05, atol=0.05)
    np.testing.assert_allclose(got, t.astype(np.float64) @ matrix, **tol)
