"""The proof tested where it can fail: one flipped bit anywhere frozen is found, nowhere trainable.

Hypothesis draws shapes (one block, several blocks, more than 2**20
elements so the chunked hashing path runs), dtypes and mask densities, then
flips one bit of one element: frozen (the first, the last, either side of a
block or chunk boundary, or anywhere) or trainable. ``verify()`` must fail
for a frozen flip and name the element's block (the element itself against
a reference); it must pass for a trainable flip. The same holds for
``finefreeze verify`` between two model files and for applying a delta.
"""

import pathlib
import tempfile

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import finefreeze as ff
from finefreeze._cli.commands import main
from finefreeze._resolve.fingerprint import BLOCK

CHUNK = 4096 * BLOCK  # elements hashed per chunk
SHAPES = {
    "one block": [(7,), (16, 16), (3, 5, 2)],
    "blocks": [(1000,), (33, 40), (2, 300, 3)],
    "chunks": [(1025, 1024)],
}
# PyTorch trains floating-point variables only (an int32 one cannot be a torch.nn.Parameter that trains)
DTYPES = ["float32", "float16", "bfloat16"] + (["int32"] if keras.backend.backend() != "torch" else [])


@st.composite
def cases(draw, kinds=("one block", "blocks", "chunks")):
    kind = draw(st.sampled_from(kinds))
    shape = draw(st.sampled_from(SHAPES[kind]))
    dtype = draw(st.sampled_from(DTYPES))
    size = int(np.prod(shape))
    density = draw(st.sampled_from([0.0, 0.001, 0.3, 0.9, 0.999]))  # share of elements trained
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    trained = rng.random(size) < density
    if trained.all():
        trained[rng.integers(size)] = False  # something stays frozen
    frozen_at = np.flatnonzero(~trained)
    edges = [0, size - 1, BLOCK - 1, BLOCK, CHUNK - 1, CHUNK, size // 2]
    near = [int(frozen_at[np.argmin(np.abs(frozen_at - e))]) for e in edges]
    where = draw(st.sampled_from(["frozen", "trainable"] if trained.any() else ["frozen"]))
    pool = near + [int(rng.choice(frozen_at))] if where == "frozen" else [int(rng.choice(np.flatnonzero(trained)))]
    at = draw(st.sampled_from(pool))
    bit = draw(st.integers(0, 8 * np.dtype(_np_dtype(dtype)).itemsize - 1))
    return shape, dtype, trained.reshape(shape), where, at, bit


def _np_dtype(dtype):
    return np.uint16 if dtype in ("float16", "bfloat16") else np.uint32


def values(shape, dtype, seed=0):
    v = np.random.default_rng(seed).normal(size=shape) * 100
    return keras.ops.convert_to_numpy(keras.ops.cast(v, dtype))


def flipped(arr, at, bit):
    """``arr`` with one bit of flat element ``at`` flipped (bytes, whatever the dtype)."""
    out = np.array(arr, copy=True)
    flat = out.reshape(-1).view(np.uint8)
    size = out.dtype.itemsize
    flat[at * size + bit // 8] ^= np.uint8(1 << (bit % 8))
    return out


def block_range(message):
    """The element ranges the fingerprint's message names, as flat (lo, hi) pairs."""
    import re

    return re.findall(r"within \(([\d, ]*)\)\.\.\(([\d, ]*)\)", message)


def _flat(index_text, shape):
    idx = tuple(int(i) for i in index_text.replace(" ", "").split(",") if i != "")
    return int(np.ravel_multi_index(idx, shape))


PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SHAPES))
@PROPERTY
@given(data=st.data())
def test_one_flipped_bit_is_found_where_frozen_and_only_there(kind, data):
    shape, dtype, trained, where, at, bit = data.draw(cases(kinds=(kind,)))
    base = values(shape, dtype)
    w = keras.Variable(base, name="w", dtype=dtype)
    u = keras.Variable(np.zeros(3, "float32"), name="u")  # trains, so a plan that freezes all of w is a plan
    rules = [ff.freeze("w"), ff.train("w", mask=trained)] if trained.any() else [ff.freeze("w")]
    frz = ff.Freezer([w, u], ff.Plan(rules))
    w.assign(flipped(base, at, bit))
    ref = [keras.Variable(base, name="w", dtype=dtype), u]
    if where == "trainable":
        frz.verify()
        frz.verify(reference=ref)
        return
    with pytest.raises(ff.FrozenValueChanged) as got:
        frz.verify()
    assert [p for p, _ in got.value.violations] == ["w"]
    ranges = block_range(str(got.value))
    assert ranges, str(got.value)
    lo, hi = (_flat(r, shape) for r in ranges[0])
    assert lo <= at <= hi and hi - lo < BLOCK  # the block of the flipped element
    with pytest.raises(ff.FrozenValueChanged) as got:
        frz.verify(reference=ref)
    assert f"differ at {tuple(int(i) for i in np.unravel_index(at, shape))}" in str(got.value)


def _model(shape, dtype, value):
    layers = [
        keras.Input((shape[0],)),
        keras.layers.Dense(shape[1], name="d", dtype=dtype),
        keras.layers.Dense(2, name="h"),
    ]
    m = keras.Sequential(layers, name="m")
    m.get_layer("d").kernel.assign(value)
    return m


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(kinds=("one block", "blocks")).filter(lambda c: len(c[0]) == 2 and c[1] != "int32"))
def test_files_and_deltas_find_the_same_flips(case):
    with tempfile.TemporaryDirectory() as tmp:
        files_and_deltas(case, pathlib.Path(tmp))


def files_and_deltas(case, tmp_path):
    """A Dense kernel as the variable: ``finefreeze verify`` on two files, then a delta onto a flipped base."""
    shape, dtype, trained, where, at, bit = case
    base = values(shape, dtype)
    rules = [ff.freeze("**/d/**"), ff.train("**/d/kernel", mask=trained)] if trained.any() else [ff.freeze("**/d/**")]
    plan = ff.Plan(rules)
    m = _model(shape, dtype, base)
    m.save(tmp_path / "base.keras")
    frz = ff.Freezer(m, plan)
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    m.get_layer("d").kernel.assign(flipped(base, at, bit))
    m.save(tmp_path / "tuned.keras")
    code = main(["verify", str(tmp_path / "base.keras"), str(tmp_path / "tuned.keras")])
    assert code == (0 if where == "trainable" else 1)
    # a delta written against the unflipped base applies to it, and refuses a base whose frozen part changed
    clean = _model(shape, dtype, base)
    cfrz = ff.Freezer(clean, plan)
    cfrz.save_delta(tmp_path / "d.safetensors")
    target = _model(shape, dtype, flipped(base, at, bit))
    if where == "trainable":
        ff.load_delta(target, tmp_path / "d.safetensors")  # the trainable part is what the delta replaces
        assert keras.ops.convert_to_numpy(target.get_layer("d").kernel).tobytes() == base.tobytes()
    else:
        with pytest.raises(ff.DeltaError):
            ff.load_delta(target, tmp_path / "d.safetensors")
