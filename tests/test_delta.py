"""Delta files: round trip, refusal of a different base, damaged files, size."""

import os

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from conftest import mlp, transformer


def tuned_pair(seed=3):
    keras.utils.set_random_seed(seed)
    base = mlp(bn=True)
    keras.utils.set_random_seed(seed)
    tuned = mlp(bn=True)
    frz = ff.Freezer(tuned, ff.Plan([ff.freeze("**/dense_0/**"), ff.freeze("**/dense_1/kernel[::2]")]))
    tuned.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.05)), loss="mse")
    rng = np.random.default_rng(0)
    tuned.fit(rng.normal(size=(64, 5)), rng.normal(size=(64, 4)), epochs=2, verbose=0)
    return base, tuned, frz


def test_delta_round_trip_reproduces_tuned_model_bit_for_bit(tmp_path):
    base, tuned, frz = tuned_pair()
    assert not all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(weights_of(base), weights_of(tuned)))
    out = frz.save_delta(tmp_path / "d.safetensors")
    assert out["bytes"] == os.path.getsize(tmp_path / "d.safetensors")
    ff.load_delta(base, tmp_path / "d.safetensors")
    for a, b in zip(weights_of(base), weights_of(tuned)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path


def test_delta_refuses_a_different_base_and_changes_nothing(tmp_path):
    _, tuned, frz = tuned_pair()
    frz.save_delta(tmp_path / "d.safetensors")
    keras.utils.set_random_seed(99)
    other = mlp(bn=True)
    before = [v.numpy().copy() for v in weights_of(other)]
    with pytest.raises(ff.DeltaError, match="fingerprint mismatch"):
        ff.load_delta(other, tmp_path / "d.safetensors")
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, weights_of(other)))


def test_delta_refuses_other_shapes(tmp_path):
    _, tuned, frz = tuned_pair()
    frz.save_delta(tmp_path / "d.safetensors")
    with pytest.raises(ff.DeltaError, match="mlp/dense_0/kernel"):
        ff.load_delta(mlp(units=(9, 6, 4), bn=True), tmp_path / "d.safetensors")


def test_truncated_delta_gives_a_clear_error(tmp_path):
    _, tuned, frz = tuned_pair()
    p = tmp_path / "d.safetensors"
    frz.save_delta(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ff.DeltaError, match="damaged or truncated"):
        ff.load_delta(mlp(bn=True), p)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_delta_of_one_percent_trainable_is_about_one_percent(tmp_path):
    m = transformer(vocab=4000, d=64, blocks=1)
    plan = ff.Plan([ff.freeze("**"), ff.train("token_embedding/embeddings[3960:]")])
    frz = ff.Freezer(m, plan)
    delta = frz.save_delta(tmp_path / "d.safetensors")["bytes"]
    m.save_weights(tmp_path / "full.weights.h5")
    full = os.path.getsize(tmp_path / "full.weights.h5")
    trainable = frz.report()["totals"]["trainable_elements"] / frz.report()["totals"]["elements"]
    ratio = delta / full
    assert trainable < 0.01
    # contiguous rows are stored as runs: the delta is about the trainable fraction
    assert ratio < 1.2 * trainable + 0.002, (ratio, trainable)
    print(f"delta / full weights file = {ratio:.4f} with {trainable:.4f} of elements trainable")


def test_scattered_elements_round_trip(tmp_path):
    w = keras.Variable(np.arange(100, dtype="float32").reshape(10, 10), name="w")
    mask = np.random.default_rng(0).random((10, 10)) < 0.5
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w", mask=mask)]))
    w.assign(np.where(mask, w.numpy(), -1.0))
    frz.save_delta(tmp_path / "d.safetensors")
    base = keras.Variable(np.arange(100, dtype="float32").reshape(10, 10), name="w")
    ff.load_delta([base], tmp_path / "d.safetensors")
    assert np.array_equal(base.numpy(), w.numpy())


def test_a_delta_of_a_model_keras_named_says_to_name_the_models_alike(tmp_path):
    def seq():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])

    trained = seq()
    frz = ff.Freezer(trained, [ff.freeze("**"), ff.train("**/d/kernel")])
    frz.save_delta(tmp_path / "d.safetensors")
    other = seq()  # Keras names it sequential_N
    assert other.name != trained.name
    with pytest.raises(ff.DeltaError, match=rf"named '{other.name}' here and was '{trained.name}'.*same name"):
        ff.load_delta(other, tmp_path / "d.safetensors")
