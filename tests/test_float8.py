"""Plans over a model Keras quantized to float8: its scaling statistics follow their layer.

``model.quantize("float8")`` keeps each kernel in float and adds, per
``Dense`` / ``EinsumDense``, scales and amax histories that Keras overwrites
with each step's new value (their "gradient", ``overwrite_with_gradient``).
They are how the layer computes, not weights: outside plans, they update
while anything of their layer trains (as in plain Keras) and stay fixed,
verified, with a frozen layer (as ``layer.trainable = False`` keeps them).
"""

import keras
import numpy as np
import pytest

import finefreeze as ff

STATISTICS = ("inputs_scale", "inputs_amax_history", "kernel_scale", "kernel_amax_history")


def _net(float8=True):
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, name="a", activation="relu")(inp)
    h = keras.layers.EinsumDense("bd,dh->bh", 24, bias_axes="h", name="e")(h)
    out = keras.layers.Dense(4, name="b")(h)
    m = keras.Model(inp, out)
    if float8:
        m.quantize("float8")
    return m


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 16)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")


def _values(model) -> dict:
    return {v.path: np.array(keras.ops.convert_to_numpy(v), copy=True) for v in model.weights}


def _fit(model, optimizer):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*_data(), batch_size=16, epochs=2, verbose=0)


def test_a_float8_layer_that_trains_updates_its_statistics_as_plain_keras_does():
    plain = _net()
    plain.get_layer("b").trainable = False
    _fit(plain, keras.optimizers.AdamW(1e-2, weight_decay=0.1))

    model = _net()
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/a/kernel"), ff.train("**/a/bias"), ff.train("**/e/*")])
    _fit(model, frz.wrap(keras.optimizers.AdamW(1e-2, weight_decay=0.1)))

    want, got = _values(plain), _values(model)
    assert want.keys() == got.keys()
    for path in want:
        assert np.array_equal(want[path], got[path]), path
    moved = _values(_net())
    for name in STATISTICS:  # they moved: the comparison above is not one of two untouched models
        assert not np.array_equal(moved[f"a/{name}"], got[f"a/{name}"]), name
    frz.verify()


def test_a_partly_trained_float8_kernel_keeps_its_frozen_elements_and_its_statistics_move():
    model = _net()
    before = _values(model)
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/a/kernel", columns="25%")])
    _fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    after = _values(model)

    a = "a"
    assert np.array_equal(before[f"{a}/kernel"][:, 8:], after[f"{a}/kernel"][:, 8:])
    assert not np.array_equal(before[f"{a}/kernel"][:, :8], after[f"{a}/kernel"][:, :8])
    for name in STATISTICS:
        assert not np.array_equal(before[f"{a}/{name}"], after[f"{a}/{name}"]), name
    for path in before:  # e and b: frozen whole, statistics included
        if not path.startswith(f"{a}/"):
            assert np.array_equal(before[path], after[path]), path
    frz.verify()
    rows = {r["path"]: r for r in frz.report()["variables"]}
    assert rows[f"{a}/inputs_amax_history"]["state"] == "trainable"
    assert rows["b/inputs_amax_history"]["state"] == "frozen"
    assert rows[f"{a}/inputs_scale"]["decided_by"] == [{"rule": "its layer", "elements": 1}]


def test_a_frozen_layers_statistics_are_verified():
    model = _net()
    frz = ff.Freezer(model, [ff.freeze("**/b/*")])
    _fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    frz.verify()
    model.get_layer("b").inputs_amax_history.assign(np.ones(1024, "float32"))
    with pytest.raises(ff.FrozenValueChanged, match="inputs_amax_history"):
        frz.verify()


def test_a_rule_on_statistics_alone_selects_nothing_and_changes_nothing():
    model = _net()
    flags = {v.path: v.trainable for v in model.weights}
    with pytest.raises(ff.PlanError, match=r"selects nothing: it matches only statistics Keras overwrites"):
        ff.Freezer(model, [ff.freeze("**"), ff.train("**/a/kernel"), ff.train("**/b/*_amax_history")])
    assert {v.path: v.trainable for v in model.weights} == flags


def test_a_float8_delta_loads_into_a_fresh_model_with_its_statistics(tmp_path):
    model = _net()
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/a/kernel", columns="25%")])
    _fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    frz.save_delta(tmp_path / "d.safetensors")

    fresh = _net()
    ff.load_delta(fresh, tmp_path / "d.safetensors")
    x = _data()[0]
    assert np.array_equal(
        keras.ops.convert_to_numpy(model.predict(x, verbose=0)), keras.ops.convert_to_numpy(fresh.predict(x, verbose=0))
    )
    want, got = _values(model), _values(fresh)
    for path in want:
        assert np.array_equal(want[path], got[path]), path


def test_select_leaves_float8_statistics_out_or_says_to_select_before_quantize():
    model = _net()
    before = _values(model)
    try:
        plan = ff.select(model, _data(), budget=0.05, loss=keras.losses.MeanSquaredError())
    except ff.PlanError as e:  # PyTorch: torch.func cannot differentiate Keras' float8 autograd.Function
        assert "Select on the model before quantize()" in str(e)
    else:  # TensorFlow, JAX: the kernels' elements, never a statistic (which a Freezer refuses to be named)
        assert not any(name in str(plan.to_dict()) for name in ("_scale", "amax_history"))
        frz = ff.Freezer(model, plan)
        assert frz.report()["totals"]["trainable_elements"] > 0
    after = _values(model)
    assert all(np.array_equal(before[p], after[p]) for p in before)


def test_a_float8_delta_into_a_float_model_says_to_quantize_it(tmp_path):
    model = _net()
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/a/kernel", columns="25%")])
    frz.save_delta(tmp_path / "d.safetensors")
    float_model = _net(float8=False)
    with pytest.raises(ff.DeltaError, match=r"quantized to float8.*model\.quantize\('float8'\)"):
        ff.load_delta(float_model, tmp_path / "d.safetensors")


def test_quantize_after_the_freezer_is_refused_naming_the_new_statistics():
    model = _net(float8=False)
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/b/kernel", columns="50%")])
    _fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    model.quantize("float8")
    with pytest.raises(ff.PlanError, match=r"a/inputs_scale") as caught:
        model.fit(*_data(), batch_size=16, verbose=0)
    assert "never saw" in str(caught.value) or "not built on" in str(caught.value)
