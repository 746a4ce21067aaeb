"""FreezingOptimizer in fit and custom loops: exactness, recipes, persistence."""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, COMPILED, FIT_MODES, gradients, train_step, weights_of
from conftest import mlp, transformer, weights


def data(n=64, d=5, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.normal(size=(n, k)).astype("float32")


def frozen_unchanged(frz, before, after):
    for path, old in before.items():
        st = frz._res.by_path(path)
        if st is None or st.state == "trainable" or st.state == "untrained":
            continue
        m = frz.frozen_mask(path)
        assert np.array_equal(old[m], after[path][m]), path


PLAN = ff.Plan([ff.freeze("**/dense_0/**"), ff.freeze("**/dense_1/kernel[::2, 1:]"), ff.freeze("**/head/bias[0]")])


@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("mode", FIT_MODES)
def test_fit_is_exact(strategy, mode):
    m = mlp()
    frz = ff.Freezer(m, PLAN, strategy=strategy)
    before = weights(m)
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.05, weight_decay=0.5)), loss="mse", **mode)
    x, y = data()
    m.fit(x, y, batch_size=16, epochs=2, verbose=0)
    after = weights(m)
    frozen_unchanged(frz, before, after)
    frz.verify()
    moved = frz.frozen_mask("mlp/dense_1/kernel")
    assert not np.array_equal(before["mlp/dense_1/kernel"][~moved], after["mlp/dense_1/kernel"][~moved])
    assert m.optimizer.iterations.numpy() == 8


def test_classic_2x2_only_diagonal_trains():
    x = keras.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], "float32"), name="x")
    frz = ff.Freezer([x], ff.Plan([ff.freeze("x"), ff.train("x", indices=[(0, 0), (1, 1)])]))
    opt = frz.wrap(keras.optimizers.Adam(0.1))
    step = train_step(opt, frz.trainable_variables, lambda: keras.ops.sum(keras.ops.square(x.value - 10.0)), COMPILED)
    for _ in range(5):
        step()
    v = x.numpy()
    assert v[0, 1] == 2.0 and v[1, 0] == 3.0
    assert v[0, 0] != 1.0 and v[1, 1] != 4.0


def _two_layer_model():
    m = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(2, activation="sigmoid", name="h"),
            keras.layers.Dense(2, activation="sigmoid", name="o"),
        ]
    )
    m.get_layer("h").set_weights([np.array([[0.0, 0.25], [0.2, 0.3]], "float32"), np.array([0.35, 0.35], "float32")])
    m.get_layer("o").set_weights([np.array([[0.4, 0.5], [0.45, 0.55]], "float32"), np.array([0.6, 0.6], "float32")])
    return m


def test_classic_sigmoid_network_matches_gradient_masking_reference():
    x = np.array([[0.05, 0.10]], "float32")
    t = np.array([[0.01, 0.99]], "float32")
    # hand-written reference: gradient x 0/1 mask with plain SGD
    ref = _two_layer_model()
    opt = keras.optimizers.SGD(0.01)
    keep = np.array([[0.0, 1.0], [1.0, 1.0]], "float32")
    for _ in range(10):
        g = gradients(
            lambda: keras.ops.mean(keras.ops.square(ref(x) - keras.ops.convert_to_tensor(t))), ref.trainable_variables
        )
        g[0] = g[0] * keep
        opt.apply_gradients(zip(g, ref.trainable_variables))
    # finefreeze
    m = _two_layer_model()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/h/kernel[0, 0]")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    m.fit(x, t, epochs=10, batch_size=1, verbose=0, shuffle=False)
    assert m.get_layer("h").kernel.numpy()[0, 0] == 0.0
    for a, b in zip(weights_of(ref), weights_of(m)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    frz.verify()


def test_freezing_a_layer_by_plan_equals_var_list_recipe():
    x, y = data()
    a = mlp()
    b = mlp()
    b.set_weights(a.get_weights())
    # var_list recipe
    opt = keras.optimizers.Adam(0.01)
    var_list = [v for v in a.trainable_variables if "dense_1" not in v.path]

    step_a = train_step(
        opt, var_list, lambda: keras.ops.mean(keras.ops.square(a(x) - keras.ops.convert_to_tensor(y))), COMPILED
    )
    for _ in range(5):
        step_a()
    # plan
    frz = ff.Freezer(b, ff.Plan([ff.freeze("**/dense_1/**")]))
    fopt = frz.wrap(keras.optimizers.Adam(0.01))

    step_b = train_step(
        fopt,
        frz.trainable_variables,
        lambda: keras.ops.mean(keras.ops.square(b(x) - keras.ops.convert_to_tensor(y))),
        COMPILED,
    )
    for _ in range(5):
        step_b()
    for va, vb in zip(weights_of(a), weights_of(b)):
        assert np.array_equal(va.numpy(), vb.numpy()), va.path


def test_two_op_recipe_with_two_freezers():
    v1 = keras.Variable(np.ones((3,), "float32"), name="v1")
    v2 = keras.Variable(np.ones((3,), "float32") * 2, name="v2")
    v3 = keras.Variable(np.ones((3,), "float32") * 3, name="v3")
    allv = [v1, v2, v3]
    fa = ff.Freezer(allv, ff.Plan([ff.freeze("v1")]))
    fb = ff.Freezer(allv, ff.Plan([ff.freeze("v2")]))
    oa, ob = fa.wrap(keras.optimizers.Adam(0.1)), fb.wrap(keras.optimizers.Adam(0.1))

    def loss():
        return keras.ops.sum(keras.ops.square(v1 * v2 * v3 - 1.0))

    for i in range(6):
        frz, opt = (fa, oa) if i % 2 == 0 else (fb, ob)
        frozen = v1 if frz is fa else v2
        snapshot = frozen.numpy().copy()
        opt.apply_gradients(zip(gradients(loss, frz.trainable_variables), frz.trainable_variables))
        assert np.array_equal(frozen.numpy(), snapshot)
    slots_a = {v.path for v in oa.inner_optimizer.variables}
    slots_b = {v.path for v in ob.inner_optimizer.variables}
    assert not any("v1" in p for p in slots_a) and any("v3" in p for p in slots_a)
    assert not any("v2" in p for p in slots_b) and any("v3" in p for p in slots_b)
    ids_a = {id(v) for v in oa.variables}
    assert not ids_a & {id(v) for v in ob.variables}
    assert oa.iterations.numpy() == 3 and ob.iterations.numpy() == 3


@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_save_load_resume_keeps_where_masks(tmp_path, strategy):
    m = mlp()
    x, y = data()
    plan = ff.Plan([ff.freeze("**/dense_0/kernel", where=lambda w: w > 0), ff.freeze("**/head/**")])
    frz = ff.Freezer(m, plan, strategy=strategy)
    base = weights(m)
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.05)), loss="mse")
    m.fit(x, y, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    m.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, ff.FreezingOptimizer)
    model_ids = {id(v) for v in weights_of(loaded)}
    assert not model_ids & {id(v) for v in loaded.optimizer.variables}
    loaded.fit(x, y, epochs=2, verbose=0)
    after = {p: v.numpy() for p, v in zip(base, weights_of(loaded))}
    mask = base["mlp/dense_0/kernel"] > 0
    assert np.array_equal(after["mlp/dense_0/kernel"][mask], base["mlp/dense_0/kernel"][mask])
    assert not np.array_equal(after["mlp/dense_0/kernel"][~mask], base["mlp/dense_0/kernel"][~mask])
    assert np.array_equal(after["mlp/head/kernel"], base["mlp/head/kernel"])
    assert loaded.optimizer.iterations.numpy() == 3 * 2


def test_model_variables_do_not_leak_into_optimizer_variables():
    m = mlp()
    frz = ff.Freezer(m, PLAN)
    opt = frz.wrap(keras.optimizers.Adam())
    opt.build(m.trainable_variables)
    model_ids = {id(v) for v in weights_of(m)}
    assert not model_ids & {id(v) for v in opt.variables}
    masks = [v for v in opt._variables if v.dtype == "bool"]
    # restore keeps one byte per partially frozen element, nothing else dense
    assert sum(int(np.prod(v.shape)) for v in masks) == 8 * 6 + 4
    assert all(v.dtype in ("bool", "int32", "int64", "float32") for v in opt._variables)  # int: iterations
    assert sum(int(np.prod(v.shape)) for v in opt._variables if v.dtype == "float32") == 1  # learning rate


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    keras.config.set_dtype_policy(policy)
    m = mlp()
    frz = ff.Freezer(m, PLAN)
    before = weights(m)
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.01, weight_decay=0.1)), loss="mse")
    if policy == "mixed_float16":
        assert isinstance(m.optimizer, keras.optimizers.LossScaleOptimizer)
        assert isinstance(m.optimizer.inner_optimizer, ff.FreezingOptimizer)
    x, y = data()
    m.fit(x, y, epochs=2, verbose=0)
    frozen_unchanged(frz, before, weights(m))
    frz.verify()


def test_loss_scale_optimizer_inside_is_refused():
    frz = ff.Freezer(mlp(), PLAN)
    with pytest.raises(TypeError, match="must stay outermost"):
        frz.wrap(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))


@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_in_frozen_gradient_never_reaches_values(strategy, bad):
    w = keras.Variable(np.ones((4, 4), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w[:2]")]), strategy=strategy)
    opt = frz.wrap(keras.optimizers.Adam(0.1, global_clipnorm=1.0))
    g = np.ones((4, 4), "float32")
    g[0, 0] = bad
    opt.apply_gradients([(keras.ops.convert_to_tensor(g), w)])
    v = w.numpy()
    assert np.all(np.isfinite(v))
    assert np.array_equal(v[:2], np.ones((2, 4), "float32"))
    assert not np.array_equal(v[2:], np.ones((2, 4), "float32"))


def test_mask_strategy_drifts_under_adamw_as_warned():
    m = mlp()
    frz = ff.Freezer(m, PLAN, strategy="mask")
    before = weights(m)
    with pytest.warns(ff.FreezeWarning, match="not exact with AdamW: weight_decay"):
        m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.05, weight_decay=0.5)), loss="mse")
        m.fit(*data(), epochs=1, verbose=0)
    mask = frz.frozen_mask("mlp/dense_1/kernel")
    assert not np.array_equal(before["mlp/dense_1/kernel"][mask], m.get_layer("dense_1").kernel.numpy()[mask])
    with pytest.raises(ff.FrozenValueChanged, match="mlp/dense_1/kernel"):
        frz.verify()


def test_mask_strategy_is_silent_and_exact_with_plain_sgd():
    import warnings

    m = mlp()
    frz = ff.Freezer(m, PLAN, strategy="mask")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ff.FreezeWarning)
        m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.05)), loss="mse")
        m.fit(*data(), epochs=1, verbose=0)
    frz.verify()


def test_learning_rate_schedule_and_scheduler_callback():
    m = mlp()
    frz = ff.Freezer(m, PLAN)
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(sched)), loss="mse")
    m.fit(*data(), epochs=1, batch_size=64, verbose=0)
    assert np.isclose(float(m.optimizer.learning_rate), 0.05)
    m2 = mlp()
    frz2 = ff.Freezer(m2, PLAN)
    m2.compile(optimizer=frz2.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    cb = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 * (epoch + 1))
    m2.fit(*data(), epochs=2, verbose=0, callbacks=[cb])
    assert np.isclose(float(m2.optimizer.learning_rate), 0.02)
    assert np.isclose(float(m2.optimizer.inner_optimizer.learning_rate), 0.02)
    frz2.verify()


def test_verify_detects_one_flipped_bit_in_a_large_variable():
    big = keras.Variable(np.random.default_rng(0).normal(size=(512, 1024)).astype("float32"), name="big")
    other = keras.Variable(np.zeros(3, "float32"), name="other")
    frz = ff.Freezer([big, other], ff.Plan([ff.freeze("big")]))
    assert frz._fingerprint.nbytes <= big.numpy().nbytes // 100  # no second copy of the model
    value = big.numpy()
    bits = value.view(np.uint32)
    bits[300, 777] ^= np.uint32(1)  # one bit of one element
    big.assign(value)
    with pytest.raises(ff.FrozenValueChanged) as e:
        frz.verify()
    assert e.value.violations[0][0] == "big"
    assert "(300, 768)..(300, 1023)" in str(e.value)


def test_transformer_with_frozen_token_embedding_rows():
    m = transformer(vocab=60)
    plan = ff.Plan([ff.freeze("**"), ff.train("token_embedding/embeddings[50:]"), ff.train("head/**")])
    frz = ff.Freezer(m, plan)
    before = weights(m)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 60, size=(32, 8)).astype("int32")
    y = rng.integers(0, 3, size=(32,))
    m.compile(
        optimizer=frz.wrap(keras.optimizers.AdamW(0.01)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    after = weights(m)
    frozen_unchanged(frz, before, after)
    emb_b, emb_a = before["token_embedding/embeddings"], after["token_embedding/embeddings"]
    assert np.array_equal(emb_b[:50], emb_a[:50])
    assert not np.array_equal(emb_b[50:], emb_a[50:])
    frz.verify()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_custom_loop_with_apply(strategy):
    w = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4), name="w")
    b = keras.Variable(np.zeros(4, "float32"), name="b")
    frz = ff.Freezer([w, b], ff.Plan([ff.freeze("w[:, 1:]")]), strategy=strategy)
    opt = frz.wrap(keras.optimizers.AdamW(0.1, weight_decay=0.5))
    before = w.numpy().copy()

    def loss():
        return keras.ops.sum(keras.ops.square(w.value)) + keras.ops.sum(b.value)

    def step():
        opt.apply(gradients(loss, frz.trainable_variables), frz.trainable_variables)

    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(step)
    for _ in range(3):
        step()
    assert np.array_equal(w.numpy()[:, 1:], before[:, 1:])
    assert not np.array_equal(w.numpy()[:, 0], before[:, 0])
    assert opt.iterations.numpy() == 3
    frz.verify()
