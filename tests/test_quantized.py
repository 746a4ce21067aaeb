"""Plans over Keras-quantized kernels: a float delta of the trained elements beside the integers.

On every backend: the integers, scales and zero points stay bit-identical
(``verify`` proves it), the forward at a zero delta is Keras' own, the
delta's update is the gradient of the trained elements alone (SGD, checked
against the gradient computed by hand), its optimizer state is the trained
elements' size, rules read the float kernel's (logical) shape, Keras' LoRA
trains beside it, and what cannot be done is a clear error that changes
nothing.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import finefreeze as ff

MODES = ["int8", "int4"]


def _bytes(model) -> dict:
    return {v.path: np.array(keras.ops.convert_to_numpy(v), copy=True) for v in model.weights}


def _net(mode, activation=None):
    rng = np.random.default_rng(3)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, name="a")(inp)
    h = keras.layers.EinsumDense("bd,dnh->bnh", (4, 4), bias_axes="nh", name="e")(h)
    h = keras.layers.Reshape((16,))(h)
    out = keras.layers.Dense(3, name="b", activation=activation)(h)
    m = keras.Model(inp, out)
    for v in m.weights:
        v.assign(rng.normal(size=v.shape).astype("float32") * 0.3)
    if mode is not None:
        m.quantize(mode)
    return m


def _data(n=32, width=12, out=3):
    rng = np.random.default_rng(5)
    return rng.normal(size=(n, width)).astype("float32"), rng.normal(size=(n, out)).astype("float32")


def _delta(model, layer):
    return np.asarray(keras.ops.convert_to_numpy(model.get_layer(layer)._finefreeze_sliced.standin))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", ["block", "scattered"])
def test_a_quantized_kernel_trains_a_float_delta_and_every_stored_byte_stays(mode, plan):
    m = _net(mode, activation="tanh")
    x, y = _data()
    y0 = np.asarray(m.predict(x, verbose=0))
    mask = np.zeros((12, 16), bool)  # in every row and column: no block smaller than the kernel holds them
    mask[np.arange(12), np.arange(12)] = True
    mask[np.arange(4), 12 + np.arange(4)] = True
    e_mask = np.zeros((16, 4, 4), bool)
    e_mask[np.arange(16), np.arange(16) % 4, np.arange(16) // 4] = True
    if plan == "block":
        rules = [ff.train("a/kernel", columns=0.25), ff.train("e/kernel", heads=0.5)]
    else:
        rules = [ff.train("a/kernel", mask=mask), ff.train("e/kernel", mask=e_mask)]
    before = _bytes(m)
    frz = ff.Freezer(m, [ff.freeze("**"), *rules, ff.train("b/bias")])
    gradients = {v["path"]: v["gradient"] for v in frz.report()["variables"] if v["path"].endswith("/kernel")}
    assert gradients == {p: "sliced" if plan == "block" else "sampled" for p in ("a/kernel", "e/kernel")} | {
        "b/kernel": None
    }
    assert np.array_equal(np.asarray(m.predict(x, verbose=0)), y0)  # a zero delta: Keras' own forward
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    frz.verify()
    after = _bytes(m)
    for path, value in before.items():
        if path.endswith("b/bias"):
            assert not np.array_equal(after[path], value)
        else:  # every integer, scale, zero point and frozen float
            assert np.array_equal(after[path], value), path
    trained = {"a": int((~frz.frozen_mask("a/kernel")).sum()), "e": int((~frz.frozen_mask("e/kernel")).sum())}
    assert trained == ({"a": 48, "e": 128} if plan == "block" else {"a": 16, "e": 16})
    for layer, n in trained.items():
        d = _delta(m, layer)
        assert d.shape == (n,) and np.count_nonzero(d) == n  # every trained element moved, nothing else exists
    rows = {v["path"]: v for v in frz.report()["variables"]}
    assert rows["a/kernel"]["quantized"] == mode and rows["a/kernel"]["shape"] == [12, 16]
    assert rows["a/kernel"]["optimizer_state_elements"] == 2 * trained["a"]  # Adam: two slots x trained
    text = frz.summary()  # the text view tags every quantized kernel: trained ones with their delta
    assert text.count(f"{mode} + float delta]") == 2 and text.count(f"[{mode}]") == 1, text
    assert not np.array_equal(np.asarray(m.predict(x, verbose=0)), y0)


@pytest.mark.parametrize("plan", ["block", "scattered"])
def test_a_quantized_kernels_delta_trains_in_an_eager_step_too(plan):
    m = _net("int8")
    x, y = _data()
    before = _bytes(m)
    mask = np.zeros((12, 16), bool)
    mask[np.arange(12), np.arange(12)] = True
    rule = ff.train("a/kernel", columns=0.25) if plan == "block" else ff.train("a/kernel", mask=mask)
    frz = ff.Freezer(m, [ff.freeze("**"), rule])
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse", run_eagerly=True)
    m.fit(x, y, epochs=1, batch_size=8, verbose=0)  # TensorFlow's eager custom gradient reads the delta's value
    frz.verify()
    after = _bytes(m)
    assert all(np.array_equal(after[p], v) for p, v in before.items())
    d = _delta(m, "a")
    assert np.count_nonzero(d) == d.size == int((~frz.frozen_mask("a/kernel")).sum())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", ["block", "scattered"])
def test_the_delta_moves_by_the_gradient_of_the_trained_elements_alone(mode, plan):
    rng = np.random.default_rng(7)
    m = keras.Sequential([keras.Input((12,)), keras.layers.Dense(5, name="a")])
    m.layers[0].kernel.assign(rng.normal(size=(12, 5)).astype("float32"))
    m.quantize(mode)
    x, y = _data(n=16, out=5)
    trained = np.zeros((12, 5), bool)
    if plan == "block":
        trained[:, 1:3] = True
    else:  # in every row and column: the elements alone
        trained[np.arange(12), np.arange(12) % 5] = True
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("**/a/kernel", mask=trained)])
    assert frz.report()["variables"][1]["gradient"] == ("sliced" if plan == "block" else "sampled")
    pred = np.asarray(m.predict(x, verbose=0), dtype=np.float64)
    dy = 2.0 * (pred - y) / y.size  # mean squared error over every output
    want = -0.1 * (x.astype(np.float64).T @ dy)[trained]  # the trained elements in sorted flat order
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    m.train_on_batch(x, y)
    # the one bound: float32 sums of 16 products in another order than float64's
    np.testing.assert_allclose(_delta(m, "a"), want, rtol=2e-5, atol=1e-7)
    frz.verify()


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_reads_the_float_kernels_shape_before_and_after_quantize(mode):
    plan = [ff.freeze("**"), ff.train("e/kernel", heads=0.25), ff.train("a/kernel[2:5, -3:]")]
    rng = np.random.default_rng(3)
    inp = keras.Input((12,))
    h = keras.layers.EinsumDense("bd,dnh->bnh", (4, 6), name="e")(inp)
    h = keras.layers.Reshape((24,))(h)
    float_model = keras.Model(inp, keras.layers.Dense(7, name="a")(h))
    for v in float_model.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    masks = {p: ff.Freezer(float_model, plan).frozen_mask(p) for p in ("e/kernel", "a/kernel")}
    float_model.quantize(mode)
    frz = ff.Freezer(float_model, plan)
    for p, mask in masks.items():
        assert np.array_equal(frz.frozen_mask(p), mask)
    assert frz.frozen_mask("a/kernel").shape == (24, 7)  # int4 packs it (24, 4)


@pytest.mark.parametrize("mode", MODES)
def test_keras_lora_trains_beside_the_delta_on_the_same_quantized_layer(mode):
    m = _net(mode)
    m.get_layer("a").enable_lora(2)
    x, y = _data()
    before = _bytes(m)
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("a/lora_*"), ff.train("a/kernel", columns=0.125)])
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    frz.verify()
    after = _bytes(m)
    moved = sorted(p for p in before if not np.array_equal(before[p], after[p]))
    assert [p.rsplit("/", 1)[-1] for p in moved] == ["lora_kernel_a", "lora_kernel_b"]
    assert np.count_nonzero(_delta(m, "a")) == 24  # 2 of 16 columns x 12 rows


def test_what_a_quantized_kernel_cannot_do_is_a_clear_error_that_changes_nothing(tmp_path):
    m = _net("int8")
    before = _bytes(m)
    with pytest.raises(ff.PlanError, match=r"int8-quantized kernel .*mask made from its values"):
        ff.Freezer(m, [ff.freeze("**"), ff.train("a/kernel", where=lambda w: w > 0)])
    with pytest.raises(ff.PlanError, match=r"every element of '.*a/kernel', an int8-quantized kernel .*\(12, 16\)"):
        ff.Freezer(m, [ff.train("a/kernel")])
    assert {p: v for p, v in _bytes(m).items()}.keys() == before.keys()
    assert all(np.array_equal(v, before[p]) for p, v in _bytes(m).items())
    assert not any(getattr(layer, "_finefreeze_sliced", None) for layer in m.layers)
    assert all(np.array_equal(v, before[p]) for p, v in _bytes(m).items())


def _trained_on_int8(rule, x, y, folder, name):
    m = _net("int8")
    frz = ff.Freezer(m, [ff.freeze("**"), rule])
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    path = os.fspath(folder / f"{name}.safetensors")
    frz.save_delta(path)
    return path, np.asarray(m.predict(x, verbose=0))


def test_deltas_of_a_quantized_base_load_switch_and_merge_bit_for_bit(tmp_path):
    x, y = _data()
    rules = {"left": ff.train("a/kernel[:, :4]"), "right": ff.train("a/kernel", mask=_right_mask())}
    files, outs = {}, {}
    for name, rule in rules.items():
        files[name], outs[name] = _trained_on_int8(rule, x, y, tmp_path, name)
    base = _net("int8")
    stored = _bytes(base)
    y_base = np.asarray(base.predict(x, verbose=0))
    loaded = _net("int8")
    assert ff.load_delta(loaded, files["left"]) == {"variables": 1, "elements": 48}  # the delta of a/kernel
    assert np.array_equal(np.asarray(loaded.predict(x, verbose=0)), outs["left"])
    switch = ff.DeltaSwitch(base, files)
    for name in ("left", "right", None, "right", "left", None):
        switch.use(name)
        assert np.array_equal(np.asarray(base.predict(x, verbose=0)), y_base if name is None else outs[name])
        switch.verify()
    assert all(np.array_equal(v, stored[p]) for p, v in _bytes(base).items() if p in stored)  # integers untouched
    merged = os.fspath(tmp_path / "both.safetensors")
    ff.merge_deltas([files["left"], files["right"]], merged)
    both = _net("int8")
    ff.load_delta(both, merged)
    a = both.get_layer("a")
    delta = np.zeros((12, 16), "float32").reshape(-1)
    delta[a._finefreeze_sliced.index] = np.asarray(keras.ops.convert_to_numpy(a._finefreeze_sliced.standin))
    assert np.count_nonzero(delta.reshape(12, 16)[:, :4]) == 48 and np.count_nonzero(delta) == 48 + _right_mask().sum()


def _right_mask():
    mask = np.zeros((12, 16), bool)
    mask[np.arange(12), 8 + np.arange(12) % 8] = True
    return mask


def test_a_quantized_bases_delta_is_refused_by_the_float_base_and_the_reverse(tmp_path):
    x, y = _data()
    path, _ = _trained_on_int8(ff.train("a/kernel", rows=0.25), x, y, tmp_path, "q")
    float_base = _net_float()
    before = _bytes(float_base)
    with pytest.raises(ff.DeltaError, match=r"made on a base whose '.*' is int8-quantized.*model.quantize\('int8'\)"):
        ff.load_delta(float_base, path)
    assert all(np.array_equal(v, before[p]) for p, v in _bytes(float_base).items())


def _net_float():
    m = _net(None)
    return m


@pytest.mark.parametrize(
    "equation, x_shape, k_shape",
    [
        ("...i,ij->...j", (6, 5), (5, 7)),
        ("btd,dnh->btnh", (2, 3, 5), (5, 2, 3)),
        ("btnh,nhd->btd", (2, 3, 2, 3), (2, 3, 4)),
    ],
)
@pytest.mark.parametrize("chunk", [None, 16])  # 16 values: the elements go a few at a time, in a loop
def test_the_product_read_at_scattered_elements_is_the_dense_products_with_its_gradients(
    equation, x_shape, k_shape, chunk, monkeypatch
):
    from finefreeze._slices import quantized as module
    from finefreeze._slices.quantized import scattered_delta

    if chunk is not None:
        monkeypatch.setattr(module, "SAMPLED_CHUNK", chunk)
    from finefreeze._slices.sampled import Sampled, padded_index

    rng = np.random.default_rng(11)
    size = int(np.prod(k_shape))
    trained = np.sort(rng.choice(size, size // 3, replace=False)).astype(np.int64)
    ins, y_spec = equation.split("->")
    x_spec, k_spec = ins.split(",")
    sampled = Sampled(x_spec, k_spec, y_spec, k_shape, len(trained), reads=padded_index(trained))
    x0 = rng.normal(size=x_shape).astype("float32")
    v0 = rng.normal(size=len(trained)).astype("float32")
    kernel = np.zeros(size, np.float64)
    kernel[trained] = v0
    kernel = kernel.reshape(k_shape)
    want_y = np.einsum(equation.replace("...", "n"), x0.astype(np.float64), kernel)
    r = rng.normal(size=want_y.shape).astype("float32")

    from finefreeze._backends.chosen import chosen

    x, v = keras.ops.convert_to_tensor(x0), keras.ops.convert_to_tensor(v0)
    f = keras.ops.convert_to_tensor(padded_index(trained).astype(np.int32))
    got_y = np.asarray(keras.ops.convert_to_numpy(scattered_delta(None, x, v, f, sampled, k_shape)))
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-6)
    dy = keras.ops.convert_to_tensor(r)  # the backend's own differentiation, through the product's custom gradient
    dv = keras.ops.convert_to_numpy(
        chosen().vjp(lambda a, b: scattered_delta(None, a, b, f, sampled, k_shape), x, v, dy)
    )
    dx = keras.ops.convert_to_numpy(
        chosen().vjp(lambda b, a: scattered_delta(None, a, b, f, sampled, k_shape), v, x, dy)
    )
    spec = equation.replace("...", "n")
    xs, rest = spec.split(",")
    ks, ys = rest.split("->")
    want_dx = np.einsum(f"{ys},{ks}->{xs}", r.astype(np.float64), kernel)
    want_dk = np.einsum(f"{xs},{ys}->{ks}", x0.astype(np.float64), r.astype(np.float64)).reshape(-1)[trained]
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv, want_dk, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="JAX's product is the gathers: no sparse product")
def test_the_sparse_product_of_scattered_elements_gathers_under_a_compiler_with_the_same_result():
    """TensorFlow's XLA (``jit_compile``) has no sparse product; ``torch.compile`` traces no sparse tensor."""
    from finefreeze._backends.chosen import chosen

    rng = np.random.default_rng(4)
    t = rng.normal(size=(8, 10)).astype("float32")
    pairs = np.sort(rng.choice(60, 20, replace=False))
    take, add = (pairs // 6).astype("int32"), (pairs % 6).astype("int32")
    v = rng.normal(size=20).astype("float32")
    matrix = np.zeros((10, 6))
    matrix[take, add] = v
    want = t.astype(np.float64) @ matrix
    v, take, add = (keras.ops.convert_to_tensor(a) for a in (v, take, add))  # the step's tensors

    def product(a):
        return chosen().scattered_product(a, v, take, add, 6, 16)  # 16 values: chunks of 2 pairs, in a loop

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(product, jit_compile=True)
    else:
        import torch

        compiled = torch.compile(product, fullgraph=True)  # fullgraph: a graph break raises
    sparse = keras.ops.convert_to_numpy(product(keras.ops.convert_to_tensor(t)))
    gathered = keras.ops.convert_to_numpy(compiled(keras.ops.convert_to_tensor(t)))
    np.testing.assert_allclose(sparse, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gathered, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_new_rows_of_a_quantized_table_train_as_a_delta_by_the_lookups_gradient(mode):
    rng = np.random.default_rng(4)
    ids = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, name="tok")(ids)
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    m = keras.Model(ids, out)
    for v in m.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    m.get_layer("tok").quantize(mode)
    x = rng.integers(0, 20, (16, 5)).astype("int32")
    x[:, 0] = 19  # every example looks up a trained row
    y = rng.normal(size=(16, 3)).astype("float32")
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("tok/embeddings[-3:]")])
    pred = np.asarray(m.predict(x, verbose=0), dtype=np.float64)
    w = np.asarray(keras.ops.convert_to_numpy(m.get_layer("head").kernel), dtype=np.float64)
    per_token = (2.0 * (pred - y) / y.size) @ w.T / x.shape[1]  # d loss / d each looked-up row
    want = np.zeros((20, 4))
    np.add.at(want, x.reshape(-1), np.repeat(per_token, x.shape[1], axis=0))
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    m.train_on_batch(x, y)
    np.testing.assert_allclose(_delta(m, "tok"), -0.1 * want[-3:].reshape(-1), rtol=2e-5, atol=1e-7)
    frz.verify()


def _fit_verified(m, frz, x, y, stored) -> None:
    """Train a table model on token targets with Adam; every frozen element and every stored byte stays."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=loss)
    m.fit(x, y, epochs=2, verbose=0)
    frz.verify()
    assert all(np.array_equal(v, stored[p]) for p, v in _bytes(m).items() if p in stored)


@pytest.mark.parametrize("mode", MODES)
def test_a_tied_quantized_tables_new_rows_add_their_delta_to_the_lookup_and_to_the_logits(mode):
    rng = np.random.default_rng(6)
    ids = keras.Input((6,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(20, 8, name="tok")
    m = keras.Model(ids, table(keras.layers.Dense(8, name="d")(table(ids)), reverse=True))
    for v in m.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    m.quantize(mode)
    stored = _bytes(m)
    x = rng.integers(0, 20, (32, 6)).astype("int32")
    y = rng.integers(0, 20, (32, 6)).astype("int32")
    y0 = np.asarray(m.predict(x, verbose=0))
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("tok/embeddings[-3:]")])
    assert np.array_equal(np.asarray(m.predict(x, verbose=0)), y0)
    _fit_verified(m, frz, x, y, stored)
    delta = _delta(m, "tok").reshape(3, 8)
    assert np.count_nonzero(delta) == 24
    ids_now = keras.ops.convert_to_tensor(np.array([[17, 18, 19, 0]], "int32"))
    looked = np.asarray(keras.ops.convert_to_numpy(table(ids_now)))
    from finefreeze._keras.quantized import quantized_lookup

    keras_own = np.asarray(keras.ops.convert_to_numpy(quantized_lookup(table, ids_now)))
    np.testing.assert_array_equal(looked[0, :3], (keras_own[0, :3] + delta).astype("float32"))
    np.testing.assert_array_equal(looked[0, 3], keras_own[0, 3])


def test_select_on_a_quantized_model_says_to_select_on_the_float_model_first():
    m = _net("int8")
    x, y = _data()
    m.compile(loss="mse")
    with pytest.raises(ff.PlanError, match=r"select: '.*a/kernel' is an int8-quantized kernel .*before quantize\(\)"):
        ff.select(m, (x, y), budget=0.1, options={"verbose": 0})
    with pytest.raises(ff.PlanError, match=r"Select on the float model before quantize"):
        ff.select(m, (x, y), budget=0.5, exclude="**/kernel", options={"verbose": 0})
    assert not any(getattr(layer, "_finefreeze_sliced", None) for layer in m.layers)


def test_columns_of_every_row_of_a_quantized_table_train_too():
    rng = np.random.default_rng(8)
    ids = keras.Input((4,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(10, 6, name="tok")
    m = keras.Model(ids, table(table(ids), reverse=True))
    for v in m.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    m.quantize("int4")
    stored = _bytes(m)
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("tok/embeddings[:, :2]")])
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=keras.losses.SparseCategoricalCrossentropy(True))
    x = rng.integers(0, 10, (16, 4)).astype("int32")
    m.fit(x, x, epochs=2, verbose=0)
    frz.verify()
    assert all(np.array_equal(v, stored[p]) for p, v in _bytes(m).items() if p in stored)
    assert np.count_nonzero(_delta(m, "tok")) == 20


def test_a_freezer_made_before_quantize_refuses_to_train_and_says_why():
    m = _net(None)
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("a/kernel[:, :4]")])
    m.quantize("int8")
    with pytest.raises(ff.PlanError, match=r"'a/kernel' was quantized \(int8\) after this Freezer was made"):
        frz.wrap(keras.optimizers.Adam())


def test_a_delta_cannot_widen_the_delta_a_live_freezer_trains(tmp_path):
    x, y = _data()
    path, _ = _trained_on_int8(ff.train("a/kernel[:, :4]"), x, y, tmp_path, "left")
    m = _net("int8")
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("a/kernel[:, 8:]")])
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    before = _delta(m, "a").copy()
    with pytest.raises(ff.DeltaError, match=r"a live Freezer trains other elements of the float delta of '.*a/kernel'"):
        ff.load_delta(m, path)
    assert np.array_equal(_delta(m, "a"), before) and before.size == 96
    m.fit(x, y, epochs=1, verbose=0)
    frz.verify()


def test_int4_tables_group_index_is_verified_and_int4_deltas_merge(tmp_path):
    x, y = _data()
    files = []
    for k, rule in enumerate([ff.train("a/kernel[:, :4]"), ff.train("a/kernel[:, 8:]")]):
        m = _net("int4")
        frz = ff.Freezer(m, [ff.freeze("**"), rule])
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
        m.fit(x, y, epochs=1, verbose=0)
        files.append(os.fspath(tmp_path / f"{k}.safetensors"))
        frz.save_delta(files[-1])
    assert ff.merge_deltas(files, os.fspath(tmp_path / "both.safetensors"))["elements"] == 48 + 96
    rng = np.random.default_rng(1)
    ids = keras.Input((3,), dtype="int32")
    t = keras.Model(ids, keras.layers.Dense(2, name="d")(keras.layers.Embedding(8, 4, name="tok")(ids)))
    for v in t.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    t.quantize("int4")
    frz = ff.Freezer(t, [ff.freeze("**"), ff.train("tok/embeddings[-2:]")])
    g_idx = t.get_layer("tok").g_idx
    g_idx.assign(np.asarray(keras.ops.convert_to_numpy(g_idx)) + 1)
    with pytest.raises(ff.FrozenValueChanged, match="g_idx"):
        frz.verify()


def test_a_checkpoint_resumes_the_deltas_bit_for_bit_and_a_saved_model_takes_its_delta_file(tmp_path):
    x, y = _data()

    def make():
        keras.utils.set_random_seed(0)
        m = _net("int8", activation="tanh")
        frz = ff.Freezer(m, [ff.freeze("**"), ff.train("a/kernel", columns=0.25), ff.train("b/bias")])
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
        return m, frz

    a, frz = make()
    a.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    a.save_weights(tmp_path / "ckpt.weights.h5")  # what BackupAndRestore writes
    a.save(tmp_path / "a.keras")
    frz.save_delta(tmp_path / "a.safetensors")
    saved = np.asarray(a.predict(x, verbose=0))
    a.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)

    b, _ = make()
    b.load_weights(tmp_path / "ckpt.weights.h5")
    assert np.asarray(b.predict(x, verbose=0)).tobytes() == saved.tobytes()
    b.fit(x, y, epochs=1, batch_size=8, verbose=0, shuffle=False)  # the deltas' optimizer state came back too
    assert _delta(b, "a").tobytes() == _delta(a, "a").tobytes() and np.abs(_delta(a, "a")).max() > 0
    mine = _bytes(a)
    assert all(v.tobytes() == mine[k].tobytes() for k, v in _bytes(b).items()) and len(mine) == len(_bytes(b))

    with warnings.catch_warnings():  # the wrapped optimizer's delta slots are not in a .keras file
        warnings.simplefilter("ignore")
        c = keras.models.load_model(tmp_path / "a.keras")
    assert not np.array_equal(np.asarray(c.predict(x, verbose=0)), saved)  # the base and the bias, not the delta
    ff.load_delta(c, tmp_path / "a.safetensors")
    assert np.asarray(c.predict(x, verbose=0)).tobytes() == saved.tobytes()


@pytest.mark.parametrize("mode", MODES)
def test_verify_against_a_reference_compares_the_stored_integers_of_either_mode(mode):
    """``verify(reference=)`` (``finefreeze verify``) reads an int4 kernel as stored: two values a byte."""
    m, ref = _net(mode), _net(mode)  # the same float weights, quantized alike
    frz = ff.Freezer(m, [ff.freeze("**"), ff.train("a/kernel[:, :4]")])
    frz.verify(reference=ref)
    for path in ("a/kernel", "e/kernel"):  # a kernel with a trained delta, and one frozen whole
        v = next(w for w in ref.weights if w.path == path)
        stored = np.array(keras.ops.convert_to_numpy(v), copy=True)
        changed = stored.copy()
        changed.reshape(-1)[3] ^= 1
        v.assign(changed)
        with pytest.raises(ff.FrozenValueChanged, match=f"{path}: 1 frozen element"):
            frz.verify(reference=ref)
        v.assign(stored)
    frz.verify(reference=ref)


def _untied(mode, seed=6):
    rng = np.random.default_rng(seed)
    ids = keras.Input((6,), dtype="int32")
    table = keras.layers.ReversibleEmbedding(20, 8, tie_weights=False, name="tok")
    m = keras.Model(ids, table(keras.layers.Dense(8, name="d")(table(ids)), reverse=True))
    for v in m.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    m.quantize(mode)
    return m, table


def _reverse(table, h):
    from finefreeze._keras.quantized import quantized_product

    mine = np.asarray(keras.ops.convert_to_numpy(table(h, reverse=True)))
    return mine, np.asarray(keras.ops.convert_to_numpy(quantized_product(table, h, reverse=True)))


@pytest.mark.parametrize("mode", MODES)
def test_an_untied_quantized_output_tables_new_columns_train_as_a_delta_of_their_own(mode, tmp_path):
    m, table = _untied(mode)
    stored = _bytes(m)
    rng = np.random.default_rng(7)
    x = rng.integers(0, 20, (32, 6)).astype("int32")
    y = rng.integers(17, 20, (32, 6)).astype("int32")  # the new tokens
    y0 = np.asarray(m.predict(x, verbose=0))
    plan = [ff.freeze("**"), ff.train("tok/embeddings[-3:]"), ff.train("tok/reverse_embeddings[:, -3:]")]
    frz = ff.Freezer(m, plan)
    gradients = {v["path"]: v["gradient"] for v in frz.report()["variables"]}
    assert gradients["tok/embeddings"] == gradients["tok/reverse_embeddings"] == "sliced"
    assert np.array_equal(np.asarray(m.predict(x, verbose=0)), y0)  # zero deltas: Keras' own logits
    _fit_verified(m, frz, x, y, stored)
    rows = _delta(m, "tok").reshape(3, 8)
    columns = np.asarray(keras.ops.convert_to_numpy(table._finefreeze_sliced_reverse.standin)).reshape(8, 3)
    assert np.count_nonzero(rows) == 24 and np.count_nonzero(columns) == 24
    h = keras.ops.convert_to_tensor(rng.normal(size=(2, 8)).astype("float32"))
    mine, own = _reverse(table, h)
    assert np.array_equal(mine[:, :-3], own[:, :-3])  # the pretrained tokens' logits: Keras' own, bit for bit
    np.testing.assert_allclose(mine[:, -3:], own[:, -3:] + np.asarray(h) @ columns, rtol=1e-5, atol=1e-6)
    # both deltas in one file, into a fresh quantized model: the same logits, bit for bit
    frz.save_delta(tmp_path / "d.safetensors")
    fresh, _ = _untied(mode)
    ff.load_delta(fresh, tmp_path / "d.safetensors")
    tuned = np.asarray(m.predict(x, verbose=0))
    assert np.array_equal(np.asarray(fresh.predict(x, verbose=0)), tuned)
    served, _ = _untied(mode)
    switch = ff.DeltaSwitch(served, {"tuned": tmp_path / "d.safetensors"})
    for name, want in (("tuned", tuned), (None, y0), ("tuned", tuned)):
        switch.use(name)
        assert np.array_equal(np.asarray(served.predict(x, verbose=0)), want), name


def test_a_delta_is_refused_by_a_quantized_model_that_holds_another_deltas_values(tmp_path):
    m, table = _untied("int8")
    x = np.random.default_rng(2).integers(0, 20, (8, 6)).astype("int32")
    y0 = np.asarray(m.predict(x, verbose=0))
    paths = {}
    for name, rule in (("rows", "tok/embeddings[-3:]"), ("columns", "tok/reverse_embeddings[:, -2:]")):
        trained, _ = _untied("int8")
        frz = ff.Freezer(trained, [ff.freeze("**"), ff.train(rule)])
        mark = (
            trained.get_layer("tok")._finefreeze_sliced
            if name == "rows"
            else trained.get_layer("tok")._finefreeze_sliced_reverse
        )
        mark.standin.assign(np.full(mark.standin.shape, 0.5, "float32"))
        paths[name] = tmp_path / f"{name}.safetensors"
        frz.save_delta(paths[name])
        del frz
    ff.load_delta(m, paths["rows"])
    tuned = np.asarray(m.predict(x, verbose=0))
    assert not np.array_equal(tuned, y0)
    with pytest.raises(ff.DeltaError, match=r"'tok/embeddings' .* holds a float delta of trained values at 24 "):
        ff.load_delta(m, paths["columns"])  # its base has no delta on the table's rows: the two would add up
    with pytest.raises(ff.DeltaError, match=r"not the base the delta was trained on"):
        ff.DeltaSwitch(m, {"columns": paths["columns"]})
    assert np.array_equal(np.asarray(m.predict(x, verbose=0)), tuned)  # refused: nothing changed
    ff.load_delta(m, paths["rows"])  # the same delta again: its own elements, rewritten
    assert np.array_equal(np.asarray(m.predict(x, verbose=0)), tuned)
    switch = ff.DeltaSwitch(_untied("int8")[0], paths)  # on the base alone, both switch in turn
    for name in ("rows", "columns", None):
        switch.use(name)


def test_an_untied_quantized_tables_rows_leave_the_logits_to_the_output_table():
    m, table = _untied("int8")
    ff.Freezer(m, [ff.freeze("**"), ff.train("tok/embeddings[-3:]")])
    table._finefreeze_sliced.standin.assign(np.ones(24, "float32"))
    h = keras.ops.convert_to_tensor(np.random.default_rng(1).normal(size=(2, 8)).astype("float32"))
    mine, own = _reverse(table, h)
    assert np.array_equal(mine, own)  # untied: the token table's delta is no part of the logits
    ids = keras.ops.convert_to_tensor(np.array([[19, 0]], "int32"))
    from finefreeze._keras.quantized import quantized_lookup

    keras_own = np.asarray(keras.ops.convert_to_numpy(quantized_lookup(table, ids)))
    looked = np.asarray(keras.ops.convert_to_numpy(table(ids)))
    assert np.array_equal(looked[0, 0], (keras_own[0, 0] + 1).astype("float32"))
    assert np.array_equal(looked[0, 1], keras_own[0, 1])


def _gptq_net():
    """An embedding, a block of two ``Dense`` that GPTQ quantizes (calibrated on random ids), a float head."""
    from keras.quantizers import GPTQConfig

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.d1, self.d2 = keras.layers.Dense(32, name="d1"), keras.layers.Dense(16, name="d2")

        def call(self, x):
            return x + self.d2(keras.activations.relu(self.d1(x)))

    keras.utils.set_random_seed(0)
    inp = keras.Input((16,), dtype="int32")
    emb, block = keras.layers.Embedding(64, 16, name="emb"), Block(name="block")
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(block(emb(inp))))
    model = keras.Model(inp, out)

    def tokenize(x):
        return np.asarray(x, dtype=np.int64).reshape(1, -1)

    tokenize.tokenize = tokenize
    rng = np.random.default_rng(0)
    config = GPTQConfig(
        dataset=[rng.integers(0, 64, (1, 16)) for _ in range(8)],
        tokenizer=tokenize,
        weight_bits=4,
        num_samples=8,
        sequence_length=16,
        group_size=-1,
        quantization_layer_structure={"pre_block_layers": [emb], "sequential_blocks": [block]},
    )
    model.quantize("gptq", config=config, filters=lambda layer: layer.name in ("d1", "d2"))
    return model


@pytest.mark.slow
def test_a_gptq_model_trains_around_its_kernels_and_a_rule_on_them_says_which_modes_train():
    model = _gptq_net()
    assert model.get_layer("block").d1.quantization_mode == "gptq"
    before = _bytes(model)
    with pytest.raises(ff.PlanError, match=r"'block/d1/kernel' holds the gptq-quantized integers.*int8 or int4"):
        ff.Freezer(model, [ff.freeze("**"), ff.train("**/d1/kernel", columns="25%")])
    frz = ff.Freezer(model, [ff.freeze("**"), ff.train("**/head/**")])
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(1)
    model.fit(rng.integers(0, 64, (32, 16)), rng.integers(0, 3, (32,)), verbose=0)
    frz.verify()
    after = _bytes(model)
    assert not np.array_equal(before["head/kernel"], after["head/kernel"])
    for path in before:
        if not path.startswith("head/"):
            assert np.array_equal(before[path], after[path]), path
