"""The promise at the seams: optimizer options, EMA on release, plan changes around the same
inner optimizer, what auto may pick, ownership, int64 indices, report = enforcement,
refused updates, resumed schedules, compact and weight-decay exclusions."""

import contextlib

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, gradients, strategy_of, weights_of
from finefreeze._backends.variables import unravel
from finefreeze._enforce.policy import choose_kind as _kind
from finefreeze._enforce.policy import index_dtype


def two_layers(name="m", seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = keras.layers.Dense(5, name="a")(x)
    return keras.Model(x, keras.layers.Dense(3, name="b")(h), name=name)


DATA = (
    np.random.default_rng(0).normal(size=(32, 6)).astype("float32"),
    np.random.default_rng(1).normal(size=(32, 3)).astype("float32"),
)


def fit(model, epochs=1, **kw):
    return model.fit(*DATA, batch_size=8, epochs=epochs, shuffle=False, verbose=0, **kw)


def snapshot(model):
    return {v.path: np.array(v.numpy(), copy=True) for v in weights_of(model)}


# -- 1. optimizer options belong to the inner optimizer ------------------------------
@pytest.mark.parametrize(
    "kwargs", [{"clipnorm": 1e-6}, {"weight_decay": 0.1}, {"use_ema": True}, {"gradient_accumulation_steps": 2}]
)
def test_wrapper_refuses_optimizer_settings(kwargs):
    with pytest.raises(TypeError, match="belong to the inner optimizer"):
        ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan(), **kwargs)


def test_settings_of_the_inner_optimizer_apply_and_survive_the_config():
    w = keras.Variable(np.zeros((3,), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
    opt = frz.wrap(keras.optimizers.SGD(0.1, clipnorm=1e-6))
    opt.apply_gradients([(keras.ops.convert_to_tensor([0.0, 100.0, 100.0]), w)])
    assert np.linalg.norm(w.numpy()) <= 0.1 * 1e-6 * 1.0001  # clipped, not a step of ~14
    assert w.numpy()[0] == 0.0
    again = ff.FreezingOptimizer.from_config(opt.get_config())
    assert again.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


# -- 2. EMA of a released layer starts at its value ---------------------------------------
def test_released_layer_keeps_its_magnitude_under_ema():
    model = two_layers()
    pretrained = np.array(model.get_layer("b").kernel.numpy(), copy=True)
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    inner = keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=None)
    model.compile(optimizer=frz.wrap(inner), loss="mse")
    fit(model, 2)
    assert np.array_equal(model.get_layer("b").kernel.numpy(), pretrained)
    frz.update(ff.Plan())  # release b
    average = {v.name: v for v in inner.variables}["b_kernel_average"]
    assert np.array_equal(average.numpy(), pretrained)  # the EMA starts where the weights are
    fit(model, 1)  # fit ends with finalize_variable_values: the EMA average is written back
    after = model.get_layer("b").kernel.numpy()
    assert np.abs(after).mean() > 0.8 * np.abs(pretrained).mean()  # was 4 % with a zero average
    assert not np.array_equal(after, pretrained)


# -- 3. a variable-level change keeps the inner optimizer and every setting ----------
def test_plan_change_keeps_the_inner_optimizer_and_its_exclusions():
    w = keras.Variable(np.ones((4,), "float32"), name="w")
    bias = keras.Variable(np.ones((4,), "float32"), name="bias")
    v = keras.Variable(np.ones((4,), "float32"), name="v")
    inner = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    inner.exclude_from_weight_decay(var_names=["bias"])
    frz = ff.Freezer([w, bias, v], ff.Plan([ff.freeze("v")]))
    opt = frz.wrap(inner)

    def step():
        def loss():
            return keras.ops.sum(w * 2.0) + 0.0 * keras.ops.sum(bias) + keras.ops.sum(v)

        tv = frz.trainable_variables
        opt.apply_gradients(zip(gradients(loss, tv), tv))

    step()
    iterations = inner.iterations
    frz.update(ff.Plan([ff.freeze("w")]))  # variable level: w frozen, v released
    step()
    assert opt.inner_optimizer is inner and inner.iterations is iterations
    assert int(inner.iterations.numpy()) == 2
    assert np.array_equal(bias.numpy(), np.ones(4, "float32"))  # still excluded from weight decay
    assert not np.array_equal(v.numpy(), np.ones(4, "float32"))


# -- 4. auto changes cost, never maths ------------------------------------------------------
@pytest.mark.parametrize("name", ["Lamb", "Adafactor", "Muon", "ScheduleFreeAdamW"])
def test_auto_never_hands_a_flat_vector_to_a_non_elementwise_optimizer(name):
    w = keras.Variable(np.ones((40, 40), "float32"), name="w")
    # 2.5 % trains (auto would pick compact for Adam), one element in every row (no Adafactor NaN)
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[:, 0]")]))
    opt = frz.wrap(getattr(keras.optimizers, name)(0.01))
    assert opt._layout.by_path("w").kind == "restore"
    assert strategy_of(frz, "w") == "restore"
    adam = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[0, 0]")])).wrap(keras.optimizers.Adam())
    assert adam._layout.by_path("w").kind == "compact"


def test_adafactor_zero_gradient_nan_is_refused_before_the_first_step():
    w = keras.Variable(np.ones((16, 16), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[3, 5]"), ff.train("w[7, 2]")]))
    with pytest.raises(ff.PlanError, match=r"Adafactor would turn training into NaN with 'w' \(shape \(16, 16\)\)"):
        frz.wrap(keras.optimizers.Adafactor(0.5))
    # the same gradient in plain Keras: NaN everywhere (why it is refused)
    plain = keras.Variable(np.ones((16, 16), "float32"))
    g = np.zeros((16, 16), "float32")
    g[3, 5] = g[7, 2] = 1.0
    keras.optimizers.Adafactor(0.5).apply_gradients([(keras.ops.convert_to_tensor(g), plain)])
    assert np.isnan(plain.numpy()).all()
    # a row of trainable elements in every column avoids it
    ok = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[3, :]")])).wrap(keras.optimizers.Adafactor(0.5))
    ok.apply_gradients([(keras.ops.ones((16, 16)), w)])
    assert np.isfinite(w.numpy()).all()


# -- 5. an optimizer trains only the model its plan was resolved against --------------
def test_optimizer_of_model_a_refuses_model_b():
    a, b = two_layers("a"), two_layers("b", seed=1)
    opt = ff.Freezer(a, ff.Plan([ff.freeze("**/a/**")])).wrap(keras.optimizers.Adam())
    b.compile(optimizer=opt, loss="mse")
    before = snapshot(b)
    with pytest.raises(ff.PlanError, match=r"'a/kernel', a variable its plan was not resolved against .*another model"):
        fit(b)
    assert all(np.array_equal(before[k], v) for k, v in snapshot(b).items())


# -- 6. int64 flat indices ---------------------------------------------------------------
def x64():
    """JAX computes in 32-bit integers unless x64 is on: int64 indices need it there."""
    if BACKEND != "jax":
        return contextlib.nullcontext()
    import jax

    return jax.enable_x64(True)


def test_flat_indices_beyond_int32_unravel_exactly():
    shape = (3, 2**16, 2**15 + 7)  # 6.4e9 elements, never allocated
    size = int(np.prod(shape, dtype=np.int64))
    assert index_dtype(2**31 - 1) == "int32" and index_dtype(2**31) == "int32" and index_dtype(2**31 + 1) == "int64"
    assert index_dtype(size) == "int64"
    flat = np.array([0, 2**31 - 1, 2**31, 2**32 + 12345, size - 1], np.int64)
    with x64():
        got = keras.ops.convert_to_numpy(unravel(keras.ops.convert_to_tensor(flat), shape))
    assert np.array_equal(got, np.stack(np.unravel_index(flat, shape), axis=1))
    try:
        wrapped = keras.ops.convert_to_numpy(unravel(keras.ops.convert_to_tensor(flat.astype(np.int32)), shape))
    except (RuntimeError, OverflowError):  # PyTorch and JAX refuse the overflow instead of wrapping
        wrapped = None
    if BACKEND == "tensorflow":  # TensorFlow wraps int32 around silently: int64 is what keeps the indices right
        assert wrapped is not None and not np.array_equal(wrapped, got)
    else:
        assert wrapped is None


def test_compact_needs_int64_indices_where_the_backend_has_them():
    """Beyond 2**31 elements compact needs int64 indices; JAX has none unless x64 is on."""
    big = 2**31 + 1
    if BACKEND == "jax":
        assert _kind("auto", 1, big, None, None) == "restore"
        with pytest.raises(ff.PlanError, match="jax_enable_x64"):
            _kind("compact", 1, big, None, None, path="w")
        with x64():
            assert _kind("compact", 1, big, None, None) == "compact" == _kind("auto", 1, big, None, None)
    else:
        assert _kind("compact", 1, big, None, None) == "compact" == _kind("auto", 1, big, None, None)
    assert _kind("auto", 1, 2**31, None, None) == "compact"


# -- 7. what is shown is what is enforced -------------------------------------------------
def test_summary_and_report_show_the_wrapped_strategy():
    w = keras.Variable(np.ones((10, 10), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[0, 0]")]))
    assert strategy_of(frz, "w") == "compact"  # before wrap: what auto gives an elementwise optimizer
    opt = frz.wrap(keras.optimizers.Adam(), strategy="restore")
    assert strategy_of(frz, "w") == "restore" == opt._layout.by_path("w").kind
    row = next(v for v in frz.report()["variables"] if v["path"] == "w")
    assert row["strategy"] == "restore"
    assert "restore" in frz.summary()


# -- 8. a refused update changes nothing --------------------------------------------------
class RefusesB(keras.optimizers.Adam):
    """A real optimizer subclass that cannot be built on layer b's variables."""

    def build(self, var_list):
        if any(v.path.startswith("b/") for v in var_list):
            raise ValueError("this optimizer cannot train layer b")
        super().build(var_list)


def test_update_that_fails_midway_leaves_training_bit_identical():
    runs = {}
    for attempt in (False, True):
        model = two_layers()
        frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
        opt = frz.wrap(RefusesB(0.01))
        model.compile(optimizer=opt, loss="mse")
        fit(model)
        if attempt:
            plan, layout, hist = frz.plan, opt._layout, len(frz.history)
            flags = [v.trainable for v in weights_of(model)]
            with pytest.raises(ValueError, match="cannot train layer b"):
                frz.update(ff.Plan())
            assert frz.plan is plan and opt._layout is layout and len(frz.history) == hist
            assert [v.trainable for v in weights_of(model)] == flags
        fit(model)
        frz.verify()
        runs[attempt] = (snapshot(model), [np.asarray(v.numpy()) for v in opt.variables])
    (w0, o0), (w1, o1) = runs[False], runs[True]
    assert all(np.array_equal(w0[k], w1[k]) for k in w0)
    assert len(o0) == len(o1) and all(np.array_equal(a, b) for a, b in zip(o0, o1))


def test_update_refused_by_the_optimizer_changes_nothing():
    model = two_layers()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    opt = frz.wrap(keras.optimizers.Adafactor(0.1))
    model.compile(optimizer=opt, loss="mse")
    fit(model)
    before = (frz.plan, opt._layout, [v.trainable for v in weights_of(model)], list(opt.variables))
    nan_plan = ff.Plan([ff.freeze("**"), ff.train("**/a/kernel[0, 0]")])
    with pytest.raises(ff.PlanError, match="Adafactor would turn training into NaN"):
        frz.update(nan_plan)
    assert (frz.plan, opt._layout) == before[:2]
    assert [v.trainable for v in weights_of(model)] == before[2] and list(opt.variables) == before[3]


# -- 9. schedules resume from a saved model ---------------------------------------------
class Record(keras.callbacks.Callback):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def on_epoch_end(self, epoch, logs=None):
        self.out[epoch] = sorted(
            "/".join(v.path.split("/")[-2:]) for v in ff.Freezer.of(self.model).trainable_variables
        )


def four_blocks(name):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))] + [keras.layers.Dense(4, name=f"block{i}") for i in range(3)]
    return keras.Sequential([*layers, keras.layers.Dense(3, name="head")], name=name)


GROUPS = ["**/block2/**", "**/block1/**", "**/block0/**"]
HEAD_ONLY = ff.Plan([ff.freeze("**"), ff.train("**/head/**")])


def compiled_four_blocks():
    """A fresh model with its Freezer and wrapped Adam, as a new process would build them."""
    model = four_blocks("s")
    frz = ff.Freezer(model, HEAD_ONLY)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    return model, frz


def straight_run():
    """Four epochs of GradualUnfreezing without interruption: trained layers per epoch, final weights."""
    seen = {}
    model, _ = compiled_four_blocks()
    fit(model, 4, callbacks=[ff.callbacks.GradualUnfreezing(GROUPS), Record(seen)])
    return seen, snapshot(model)


@pytest.mark.slow
def test_gradual_unfreezing_resumes_from_load_model(tmp_path):
    straight, straight_weights = straight_run()
    resumed = {}
    model, frz = compiled_four_blocks()
    fit(model, 2, callbacks=[ff.callbacks.GradualUnfreezing(GROUPS), Record(resumed)])
    model.save(tmp_path / "mid.keras")
    loaded = keras.models.load_model(tmp_path / "mid.keras")
    again = ff.Freezer.of(loaded)
    assert again is not None and ff.Freezer.of(loaded) is again
    assert [v.path for v in again.trainable_variables] == [v.path[2:] for v in frz.trainable_variables]  # no "s/"
    fit(loaded, 4, initial_epoch=2, callbacks=[ff.callbacks.GradualUnfreezing(GROUPS), Record(resumed)])
    assert resumed == straight
    again.verify()
    # the saved optimizer state came back with the plan: the resumed run is the straight run, bit for bit
    end = {"/".join(k.split("/")[-2:]): v for k, v in snapshot(loaded).items()}
    assert all(np.array_equal(end["/".join(k.split("/")[-2:])], v) for k, v in straight_weights.items())


@pytest.mark.slow
def test_gradual_unfreezing_resumes_under_backup_and_restore(tmp_path):
    straight, _ = straight_run()

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    seen = {}
    backup = str(tmp_path / "backup")
    for interrupted in (True, False):  # the second time, a new process builds everything again
        model, frz = compiled_four_blocks()
        cbs = [ff.callbacks.GradualUnfreezing(GROUPS), keras.callbacks.BackupAndRestore(backup), Record(seen)]
        if interrupted:
            with pytest.raises(RuntimeError, match="interrupted"):
                fit(model, 4, callbacks=[*cbs, Interrupt()])
        else:
            fit(model, 4, callbacks=cbs)
    assert seen == straight
    frz.verify()


# -- 10. compact and optimizers that look at the variable ----------------------------------
@pytest.mark.parametrize(
    "exclusion, w_decays",
    [("var_list", False), (["^w"], False), (["w"], False), (["compact"], True), (["_"], True), ([r"\."], True)],
)
def test_compact_decays_exactly_like_its_variable(exclusion, w_decays):
    """Exclusions by identity or name pattern: the compact vector follows its model variable, never its own name."""
    out = {}
    for strategy in ("restore", "compact"):
        w = keras.Variable(np.ones((10, 10), "float32"), name="w")
        u = keras.Variable(np.ones((3,), "float32"), name="u")
        inner = keras.optimizers.AdamW(0.1, weight_decay=0.5)
        frz = ff.Freezer([w, u], ff.Plan([ff.freeze("w"), ff.train("w[0, :2]")]), strategy=strategy)
        opt = frz.wrap(inner)
        if exclusion == "var_list":
            opt.exclude_from_weight_decay(var_list=[w])  # on the wrapper: goes to the inner optimizer
        else:
            inner.exclude_from_weight_decay(var_names=exclusion)
        for _ in range(3):
            opt.apply_gradients([(keras.ops.zeros((10, 10)), w), (keras.ops.ones((3,)), u)])
        assert strategy_of(frz, "w") == strategy
        out[strategy] = (w.numpy().copy(), u.numpy().copy())
    untouched = np.array_equal(out["compact"][0], np.ones((10, 10), "float32"))
    assert untouched != w_decays  # a zero gradient: only weight decay can move w
    assert np.array_equal(out["restore"][0], out["compact"][0])
    assert np.array_equal(out["restore"][1], out["compact"][1])


def test_schedule_free_adamw_trains_from_the_weights_not_from_zeros():
    def run(plan_strategy, plain=False):
        w = keras.Variable(np.arange(100, dtype="float32").reshape(10, 10), name="w")
        g = keras.ops.convert_to_tensor(np.ones((10, 10), "float32"))
        if plain:
            opt = keras.optimizers.ScheduleFreeAdamW(0.001)
            opt.apply_gradients([(g, w)])
            return w.numpy()
        frz = ff.Freezer(
            [w], ff.Plan([ff.freeze("w"), ff.train("w[0, 4]"), ff.train("w[5, 1]")]), strategy=plan_strategy
        )
        frz.wrap(keras.optimizers.ScheduleFreeAdamW(0.001)).apply_gradients([(g, w)])
        return w.numpy()

    plain, auto, restore = run(None, plain=True), run("auto"), run("restore")
    for i, j in ((0, 4), (5, 1)):
        assert auto[i, j] == restore[i, j] == plain[i, j]  # about 4.0 and 51.0, not -0.001
    assert abs(auto[0, 4] - 4.0) < 0.01


# -- 11. gradient norms: what trains and what the plan blocked -----------------------------
@pytest.mark.parametrize("strategy", ["restore", "compact", "mask"])
def test_gradient_norms_match_a_tape(strategy):
    rng = np.random.default_rng(0)
    w = keras.Variable(rng.normal(size=(20, 10)).astype("float32"), name="w")
    u = keras.Variable(rng.normal(size=(10,)).astype("float32"), name="u")
    v = keras.Variable(rng.normal(size=(10,)).astype("float32"), name="v")
    mask = np.ones((20, 10), bool)
    mask[0, :5] = False  # 5 of 200 trainable: compact is allowed
    frz = ff.Freezer([w, u, v], ff.Plan([ff.freeze("v"), ff.freeze("w", mask=mask)]), strategy=strategy)
    opt = frz.wrap(keras.optimizers.SGD(0.1))
    opt._track_gradient_norms = True
    x = keras.ops.convert_to_tensor(rng.normal(size=(8, 20)).astype("float32"))
    loss = lambda: keras.ops.sum(keras.ops.tanh(keras.ops.matmul(x, w) + u + v))  # noqa: E731
    g_w, g_u = (keras.ops.convert_to_numpy(t) for t in gradients(loss, [w, u]))
    opt.apply_gradients(zip([keras.ops.convert_to_tensor(g_w), keras.ops.convert_to_tensor(g_u)], [w, u]))
    trained = np.sqrt((g_w[~mask] ** 2).sum() + (g_u**2).sum())
    blocked = np.sqrt((g_w[mask] ** 2).sum())
    got = opt._gradient_norms()
    np.testing.assert_allclose(got, (trained, blocked), rtol=1e-5)
    assert blocked > trained  # 195 frozen elements against 15 trained ones: not a zero by construction


@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_float16_moments_nan_from_zero_gradients_stays_out(strategy):
    """Adam in float16 with an epsilon that underflows turns a zero gradient into NaN (plain Keras too)."""
    plain = keras.Variable(np.ones((4,), "float16"), dtype="float16")
    keras.optimizers.Adam(0.01, epsilon=1e-8).apply_gradients([(keras.ops.zeros((4,), "float16"), plain)])
    assert np.isnan(plain.numpy()).all()
    w = keras.Variable(np.ones((50, 4), "float16"), name="w", dtype="float16")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[0]")]), strategy=strategy)
    opt = frz.wrap(keras.optimizers.Adam(0.01, epsilon=1e-8))
    for _ in range(3):
        opt.apply_gradients([(keras.ops.ones((50, 4), "float16"), w)])
    assert strategy_of(frz, "w") == strategy
    assert np.array_equal(w.numpy()[1:], np.ones((49, 4), "float16"))  # frozen: bit-identical, no NaN
    assert np.isfinite(w.numpy()[0]).all() and (w.numpy()[0] < 1).all()
    frz.verify()


# -- found by trying it as a stranger ---------------------------------------------------------
def test_auto_keeps_the_sparse_path_of_embeddings():
    """Embedding gradients arrive sparse on TensorFlow; compact's vector gets them sparse too.

    Keras' sparse update of the trained rows is kept bit for bit (auto compacts: state for the
    trained rows only). JAX and PyTorch have no sparse path: there auto compacts, with the same values.
    """
    vocab = 60
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (32, 3))
    x[:, 0] = rng.integers(50, vocab, 32)  # the trained rows, missing from some batches (a dense update moves them)
    y = rng.normal(size=(32, 2)).astype("float32")

    def run(strategy):
        keras.utils.set_random_seed(0)
        i = keras.Input((3,), dtype="int32")
        e = keras.layers.Embedding(vocab, 4, name="emb")(i)
        m = keras.Model(i, keras.layers.Dense(2, name="head")(keras.layers.Flatten()(e)))
        # 3 % trains, on the table's own gradient (gradients="auto" gives the rows a stand-in: test_slices_rows)
        frz = ff.Freezer(m, ff.Plan([ff.freeze(f"emb/embeddings[:{vocab - 2}]")]), gradients="dense")
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01), strategy=strategy), loss="mse")
        m.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        return strategy_of(frz, "emb/embeddings"), m.get_layer("emb").embeddings.numpy()

    (auto_kind, auto), (_, restore) = run("auto"), run("restore")
    assert auto_kind == "compact"
    assert np.array_equal(auto, restore)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.Adagrad(0.1), lambda: keras.optimizers.Ftrl(0.1)])
def test_released_elements_start_from_the_initial_accumulator(make):
    """Fresh state is what Keras gives at build: Adagrad's and Ftrl's accumulators start at 0.1, not 0."""
    w = keras.Variable(np.ones((3, 2), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
    opt = frz.wrap(make())
    opt.apply_gradients([(keras.ops.ones((3, 2)), w)])
    frz.update(ff.Plan())  # release row 0
    acc = {v.name: v.numpy() for v in opt.inner_optimizer.variables}["w_accumulator"]
    fresh = make()
    fresh.build([keras.Variable(np.ones((3, 2), "float32"))])
    start = {v.name.split("_")[-1]: v.numpy() for v in fresh.variables}["accumulator"]
    assert np.array_equal(acc[0], start[0])  # released row: as at build
    assert not np.array_equal(acc[1], start[1])  # trained rows: kept


def test_adafactor_accepts_a_matrix_frozen_whole_inside_a_3d_kernel():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6, 3)), keras.layers.Conv1D(5, 3, name="c")], name="cm")
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/c/kernel[0]")]))  # tap 0 of (3, 3, 5) frozen whole
    m.compile(optimizer=frz.wrap(keras.optimizers.Adafactor(0.01)), loss="mse")
    rng = np.random.default_rng(0)
    m.fit(rng.normal(size=(4, 6, 3)), rng.normal(size=(4, 4, 5)), verbose=0, epochs=3)
    assert all(np.isfinite(v.numpy()).all() for v in weights_of(m))
    frz.verify()
    with pytest.raises(ff.PlanError, match="Adafactor would turn training into NaN"):  # row + column of tap 1
        ff.Freezer(m, ff.Plan([ff.freeze("**/c/kernel[1]"), ff.train("**/c/kernel[1, 0, 0]")])).wrap(
            keras.optimizers.Adafactor(0.01)
        )


def test_the_compiled_optimizer_is_what_the_summary_shows():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((50,)), keras.layers.Dense(40, name="d1"), keras.layers.Dense(3)], name="m")
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/d1/kernel"), ff.train("**/d1/kernel[0, :20]")]))
    opt = frz.wrap(keras.optimizers.Adam(1e-3), strategy="compact")
    spare = frz.wrap(keras.optimizers.SGD(1e-3), strategy="restore")  # made later, never compiled
    m.compile(optimizer=opt, loss="mse")
    m.fit(np.random.rand(8, 50), np.random.rand(8, 3), verbose=0)
    assert strategy_of(frz, "m/d1/kernel") == "compact" == opt._layout.by_path("m/d1/kernel").kind
    assert spare._layout.by_path("m/d1/kernel").kind == "restore"


def test_gradient_norms_are_none_unless_recorded():
    w = keras.Variable(np.ones((3,), "float32"), name="w")
    opt = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")])).wrap(keras.optimizers.SGD(0.1))
    opt.apply_gradients([(keras.ops.ones((3,)), w)])
    assert opt._gradient_norms() is None


def test_wrapper_messages_name_the_real_fix():
    w = keras.Variable(np.ones((3,), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
    with pytest.raises(TypeError, match=r"keras\.optimizers\.SGD\(\.\.\., clipnorm=\.\.\.\)"):
        ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan(), clipnorm=1.0)
    with pytest.raises(TypeError, match="unknown argument"):
        ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan(), bogus=1)
    with pytest.raises(TypeError, match="cannot wrap another FreezingOptimizer"):
        frz.wrap(frz.wrap(keras.optimizers.Adam()))


def test_a_loaded_freezer_history_starts_at_the_saved_step(tmp_path):
    model = two_layers()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("a/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    fit(model)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert ff.Freezer.of(loaded).history[0]["step"] == 4


def test_a_layer_switched_off_by_hand_is_said_at_wrap():
    model = two_layers()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("a/**")]))
    model.get_layer("b").trainable = False  # after the Freezer: Keras will not train b
    with pytest.warns(ff.FreezeWarning, match=r"the plan trains b/kernel, b/bias, but Keras' trainable flag is off"):
        frz.wrap(keras.optimizers.Adam())
