"""Dynamic freezing: Freezer.update, FreezeSchedule, GradualUnfreezing, retracing, state carried over."""

import gc
import weakref

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from optimizers import OPTIMIZERS

TRACES = []
# PyTorch runs Keras' train step eagerly: no trace to count (the loss runs every
# step), so there "no retrace" means the same train function and nothing more.
TRACING = keras.backend.backend() != "torch"
# Keras refuses steps_per_execution > 1 on PyTorch.
SPE = [1, 2] if TRACING else [1]


def counting_mse(y, p):
    """MSE that counts its Python calls: once per trace of the train function in graph mode."""
    TRACES.append(1)
    return keras.ops.mean(keras.ops.square(y - p), axis=-1)


def two_branch(name="tb"):
    """Output = [branch a(x), branch b(x)]: with an MSE loss, each branch's gradient ignores the other."""
    x = keras.Input((6,))
    a = keras.layers.Dense(3, name="a")(x)
    b = keras.layers.Dense(3, name="b")(x)
    return keras.Model(x, keras.layers.Concatenate(name="cat")([a, b]), name=name)


DATA = (
    np.random.default_rng(0).normal(size=(32, 6)).astype("float32"),
    np.random.default_rng(1).normal(size=(32, 6)).astype("float32"),
)

# global_clipnorm couples every variable's step to the others' gradients, so
# branch a cannot follow a run in which branch b never trains: its transitions
# are checked for exactness, not against the uninterrupted run.
COUPLED = {"adam_global_clipnorm"}


def snapshot(model):
    return {v.path: np.array(v.numpy(), copy=True) for v in weights_of(model)}


def fit(model, epochs=2):
    model.fit(*DATA, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.parametrize("name", OPTIMIZERS.keys())
@pytest.mark.parametrize(
    "order", ["freeze_then_unfreeze", pytest.param("unfreeze_then_freeze", marks=pytest.mark.slow)]
)
def test_transitions_are_exact_and_keep_state_of_what_stays_trainable(name, order):
    """Branch a trains throughout; branch b changes. a must follow an uninterrupted run bit for bit."""
    make_opt = OPTIMIZERS[name]
    keras.utils.set_random_seed(7)
    ref = two_branch("ref")
    keras.utils.set_random_seed(7)
    model = two_branch("m")
    ref_frz = ff.Freezer(ref, ff.Plan([ff.freeze("b/**")]))
    ref.compile(optimizer=ref_frz.wrap(make_opt()), loss="mse")
    fit(ref)
    fit(ref)  # two fits like the run below (fit ends with finalize_variable_values: EMA)

    first, second = (
        (ff.Plan([ff.freeze("b/**")]), ff.Plan([ff.freeze("b/kernel[:3]")]))
        if order == "freeze_then_unfreeze"
        else (ff.Plan([ff.freeze("b/kernel[:3]")]), ff.Plan([ff.freeze("b/**")]))
    )
    frz = ff.Freezer(model, first)
    model.compile(optimizer=frz.wrap(make_opt()), loss="mse")
    fit(model)
    frz.verify()
    mid = snapshot(model)
    frz.update(second)
    fit(model)
    frz.verify()
    end = snapshot(model)
    frozen_then = frz.frozen_mask("b/kernel")
    assert np.array_equal(mid["b/kernel"][frozen_then], end["b/kernel"][frozen_then])
    if order == "freeze_then_unfreeze":
        assert not np.array_equal(mid["b/kernel"][3:], end["b/kernel"][3:])  # released rows trained
    else:
        assert np.array_equal(mid["b/bias"], end["b/bias"])
    assert (
        int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        == int(keras.ops.convert_to_numpy(ref.optimizer.iterations))
        > 0
    )
    if name in COUPLED:
        return
    for p in ("a/kernel", "a/bias"):
        assert np.array_equal(end[p], weights_of(ref.get_layer("a"))[0 if p.endswith("kernel") else 1].numpy()), p


def test_newly_trainable_elements_start_with_zero_state_and_newly_frozen_release_it():
    keras.utils.set_random_seed(3)
    model = two_branch()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    opt = frz.wrap(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse")
    fit(model, 1)
    names = lambda: {v.name for v in opt.inner_optimizer.variables}  # noqa: E731
    assert not any(n.startswith("b_") for n in names())
    a_slots = [weakref.ref(v) for v in opt.inner_optimizer.variables if v.name.startswith("a_kernel")]
    frz.update(ff.Plan([ff.freeze("a/**")]))
    gc.collect()
    assert a_slots and not any(ref() is not None for ref in a_slots)  # released, not just unused
    assert any(n.startswith("b_kernel") for n in names()) and not any(n.startswith("a_") for n in names())
    slots = [v for v in opt.inner_optimizer.variables if v.name.startswith("b_kernel")]
    assert slots and all(np.array_equal(v.numpy(), np.zeros(v.shape)) for v in slots)
    fit(model, 1)
    frz.verify()


def test_element_mask_change_does_not_retrace_and_moves_the_frozen_set():
    keras.utils.set_random_seed(5)
    model = two_branch()
    # gradients="dense": the slice of a sliced kernel is part of the traced step (test_slices.py)
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/kernel[:3]")]), strategy="restore", gradients="dense")
    # Keras' one step count: the release below needs no count of its own (see test_fresh_state.py)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.01), step_count="global"), loss=counting_mse)
    fit(model, 1)
    fn, traces = model.train_function, len(TRACES)
    frz.update(ff.Plan([ff.freeze("b/kernel[3:]")]))
    before = snapshot(model)
    fit(model, 1)
    assert model.train_function is fn and (not TRACING or len(TRACES) == traces)
    after = snapshot(model)
    assert np.array_equal(before["b/kernel"][3:], after["b/kernel"][3:])
    assert not np.array_equal(before["b/kernel"][:3], after["b/kernel"][:3])
    frz.update(ff.Plan([ff.freeze("b/**")]))  # a variable-level change retraces
    fit(model, 1)
    assert model.train_function is not fn and (not TRACING or len(TRACES) > traces)
    frz.verify()
    assert [h["retraced"] for h in frz.history] == [False, False, True]


def test_compact_element_change_with_same_count_does_not_retrace_and_carries_state():
    keras.utils.set_random_seed(5)
    model = two_branch()
    plan = ff.Plan([ff.freeze("b/kernel"), ff.train("b/kernel[0, :2]")])
    frz = ff.Freezer(model, plan, strategy="compact", gradients="dense")  # a slice would be traced in
    opt = frz.wrap(keras.optimizers.Adam(0.01), step_count="global")  # (0,2) below needs no count of its own
    model.compile(optimizer=opt, loss=counting_mse)
    fit(model, 1)
    assert TRACES
    state = {v.name: v.numpy().copy() for v in opt.inner_optimizer.variables if ".compact_" in v.name}
    fn, traces = model.train_function, len(TRACES)
    frz.update(ff.Plan([ff.freeze("b/kernel"), ff.train("b/kernel[0, 1:3]")]))  # keeps (0,1), adds (0,2)
    for name, old in state.items():
        new = next(v.numpy() for v in opt.inner_optimizer.variables if v.name == name)
        assert new[0] == old[1] and new[1] == 0.0, name  # (0,1) moved from slot 1 to 0; (0,2) fresh
    fit(model, 1)
    assert model.train_function is fn and (not TRACING or len(TRACES) == traces)
    frz.verify()


def test_verify_remembers_violations_before_a_plan_change():
    keras.utils.set_random_seed(5)
    model = two_branch()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    k = model.get_layer("b").kernel
    k.assign(k.numpy() + 1.0)  # someone writes a frozen variable
    frz.update(ff.Plan([ff.freeze("a/**")]))
    with pytest.raises(ff.FrozenValueChanged, match="before the plan change"):
        frz.verify()


def test_bad_update_changes_nothing():
    keras.utils.set_random_seed(5)
    model = two_branch()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    fit(model, 1)
    flags = [v.trainable for v in weights_of(model)]
    with pytest.raises(ff.PlanError, match="selects nothing"):
        frz.update(ff.Plan([ff.freeze("c/**")]))
    assert [v.trainable for v in weights_of(model)] == flags and len(frz.history) == 1
    assert frz.plan == ff.Plan([ff.freeze("b/**")])


def blocks_model():
    x = inp = keras.Input((8,))
    for i in range(4):
        x = keras.layers.Dense(8, activation="tanh", name=f"block_{i}")(x)
    out = keras.layers.Dense(2, name="head")(x)
    return keras.Model(inp, out, name="net")


def head_only(opt, seed=2, steps_per_execution=1):
    """A 4-block model whose plan trains only the head, compiled with ``opt`` wrapped."""
    keras.utils.set_random_seed(seed)
    model = blocks_model()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("head/**")]))
    model.compile(optimizer=frz.wrap(opt), loss="mse", steps_per_execution=steps_per_execution)
    return model, frz


def block_data(n=32):
    return np.random.default_rng(0).normal(size=(n, 8)), np.random.default_rng(1).normal(size=(n, 2))


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPE)
def test_gradual_unfreezing_releases_exactly_the_top_groups(spe):
    model, frz = head_only(keras.optimizers.AdamW(0.01), seed=11, steps_per_execution=spe)
    groups = [f"block_{i}/**" for i in (3, 2, 1, 0)]
    changed = []

    class Watch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.before = snapshot(model)

        def on_epoch_end(self, epoch, logs=None):
            after = snapshot(model)
            changed.append({p.split("/")[0] for p in after if not np.array_equal(after[p], self.before[p])})

    x, y = block_data()
    cbs = [ff.callbacks.GradualUnfreezing(groups), Watch()]
    model.fit(x, y, batch_size=8, epochs=5, verbose=0, validation_data=(x, y), callbacks=cbs)
    for epoch, got in enumerate(changed):
        want = {"head"} | {f"block_{i}" for i in (3, 2, 1, 0)[:epoch]}
        assert got == want, (epoch, got)
    frz.verify()


def test_freeze_schedule_by_step_and_by_epoch():
    model, frz = head_only(keras.optimizers.SGD(0.1))
    x, y = block_data()
    sched = ff.callbacks.FreezeSchedule({3: ff.Plan([ff.freeze("head/**")])}, by="step")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[sched])
    assert [h["step"] for h in frz.history] == [0, 3]
    assert frz.variable_state("head/kernel") == "frozen"
    frz.verify()
    with pytest.raises(ff.PlanError, match="FreezeSchedule plan for epoch 1"):
        model.fit(x, y, verbose=0, callbacks=[ff.callbacks.FreezeSchedule({1: ff.Plan([ff.freeze("nope/**")])})])
    with pytest.raises(ff.PlanError, match="integer epoch"):
        ff.callbacks.FreezeSchedule({-1: ff.Plan()})


def test_report_shows_plan_changes_and_lr_scales():
    model, frz = head_only(keras.optimizers.SGD(0.1))
    model.fit(np.ones((8, 8)), np.ones((8, 2)), verbose=0)
    frz.update(frz.plan.train("block_3/**", lr_scale=0.25))
    rep = frz.report()
    assert rep["lr_scales"] == [{"rule": "3: train('block_3/**', lr_scale=0.25)", "lr_scale": 0.25, "elements": 72}]
    assert [h["step"] for h in rep["history"]] == [0, 1]
    text = frz.summary()
    assert "Learning-rate scale 0.25 for 72 elements" in text and "Plan changes:" in text


def test_update_survives_save_and_load(tmp_path):
    keras.utils.set_random_seed(4)
    model = two_branch()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("b/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    fit(model, 1)
    frz.update(ff.Plan([ff.freeze("a/kernel[0]"), ff.train("b/**", lr_scale=0.5)]))
    fit(model, 1)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.name == b.name and np.array_equal(a.numpy(), b.numpy()), a.name
    before = snapshot(loaded)
    loaded.fit(*DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.fit(*DATA, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = snapshot(loaded)
    assert np.array_equal(before["a/kernel"][0], after["a/kernel"][0])
    for p, v in snapshot(model).items():
        assert np.array_equal(v, after[p]), p


@pytest.mark.parametrize("spe", SPE)
def test_freeze_schedule_with_steps_per_execution_changes_at_the_next_boundary(spe):
    model, frz = head_only(keras.optimizers.SGD(0.1), steps_per_execution=spe)
    x, y = block_data(48)
    sched = ff.callbacks.FreezeSchedule({3: ff.Plan([ff.freeze("head/**")])}, by="step")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[sched])
    # Keras calls back every spe steps: with 2, at 0, 2, 4 -> the change lands at 4.
    assert [h["step"] for h in frz.history] == [0, 4 if spe == 2 else 3]
    frz.verify()


def test_transition_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_float16")
    model, frz = head_only(keras.optimizers.AdamW(0.01))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = block_data()
    cb = ff.callbacks.GradualUnfreezing(["block_3/**", "block_2/kernel[:4]"])
    before = snapshot(model)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[cb])
    after = snapshot(model)
    assert not np.array_equal(before["block_3/kernel"], after["block_3/kernel"])
    assert np.array_equal(before["block_2/kernel"][4:], after["block_2/kernel"][4:])
    assert not np.array_equal(before["block_2/kernel"][:4], after["block_2/kernel"][:4])
    assert np.array_equal(before["block_0/kernel"], after["block_0/kernel"])
    frz.verify()


def test_freeze_schedule_by_epoch_with_validation_and_steps_per_execution():
    model, frz = head_only(keras.optimizers.AdamW(0.01), steps_per_execution=max(SPE))
    x, y = block_data()
    sched = ff.callbacks.FreezeSchedule({1: ff.Plan([ff.freeze("**"), ff.train("block_0/**")])})
    before = snapshot(model)
    hist = model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y), callbacks=[sched])
    after = snapshot(model)
    assert len(hist.history["val_loss"]) == 2
    assert [h["step"] for h in frz.history] == [0, 4]
    assert not np.array_equal(before["block_0/kernel"], after["block_0/kernel"])  # trained in epoch 1
    assert not np.array_equal(before["head/kernel"], after["head/kernel"])  # trained in epoch 0
    assert np.array_equal(before["block_1/kernel"], after["block_1/kernel"])
    frz.verify()


def test_stage_plans_before_fit_with_a_freezer_given_and_out_of_range_stages_refused():
    m = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="low"), keras.layers.Dense(2, name="head")], name="m"
    )
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**")]))
    given = ff.callbacks.GradualUnfreezing(["**/low/**"], freezer=frz)
    assert [repr(r) for r in given.stage_plan(1).rules] == [*map(repr, frz.plan.rules), "train('**/low/**')"]
    assert given.stage_plan(0).rules == frz.plan.rules
    for k in (2, -1):
        with pytest.raises(ff.PlanError, match=rf"stage_plan\({k}\): give 0 to 1"):
            given.stage_plan(k)
    with pytest.raises(ff.PlanError, match="give freezer= or call it once fit has started"):
        ff.callbacks.GradualUnfreezing(["**/low/**"]).stage_plan(1)
