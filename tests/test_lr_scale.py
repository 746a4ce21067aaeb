"""lr_scale: the step is scaled (not the gradient), per group, with every optimizer, schedules, strategies, save/load."""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from optimizers import OPTIMIZERS

# Steps are differences of weights near 1: float32 rounds them to about 1e-7.
ATOL = 5e-7


def variables():
    """Two variables with the same values, so that their only difference is the lr_scale."""
    value = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    return keras.Variable(value, name="w"), keras.Variable(value, name="u")


def linear_steps(plan, make_opt, steps=3, strategy="auto"):
    """Constant gradients (a linear loss): every optimizer's state evolves the same, whatever the weights."""
    w, u = variables()
    frz = ff.Freezer([w, u], plan, strategy=strategy)
    opt = frz.wrap(make_opt())
    g = keras.ops.convert_to_tensor(np.linspace(-1, 1, 12).reshape(4, 3).astype("float32"))
    start = w.numpy().copy(), u.numpy().copy()
    for _ in range(steps):
        opt.apply_gradients([(g, w), (g, u)])
    return (w.numpy() - start[0]), (u.numpy() - start[1]), opt


def test_sgd_group_with_lr_scale_moves_exactly_a_tenth():
    dw, du, _ = linear_steps(ff.Plan([ff.train("u", lr_scale=0.1)]), lambda: keras.optimizers.SGD(0.5))
    np.testing.assert_allclose(du, 0.1 * dw, rtol=1e-5, atol=ATOL)
    assert not np.allclose(du, dw)


def test_adam_scales_the_step_not_the_gradient():
    dw, du, opt = linear_steps(ff.Plan([ff.train("u", lr_scale=0.1)]), lambda: keras.optimizers.Adam(0.01))
    np.testing.assert_allclose(du, 0.1 * dw, rtol=1e-5, atol=ATOL)
    # scaling the gradient instead would leave Adam's step unchanged (it is scale-invariant)
    w, _ = variables()
    ref = keras.optimizers.Adam(0.01)
    g = keras.ops.convert_to_tensor(np.linspace(-1, 1, 12).reshape(4, 3).astype("float32"))
    start = w.numpy().copy()
    for _ in range(3):
        ref.apply_gradients([(0.1 * g, w)])
    np.testing.assert_allclose(w.numpy() - start, dw, rtol=1e-3)
    # and the two groups keep their own, unscaled Adam statistics: same gradient, same moments
    inner = {v.name: v.numpy() for v in opt.inner_optimizer.variables}
    assert np.array_equal(inner["w_momentum"], inner["u_momentum"])
    assert np.array_equal(inner["w_velocity"], inner["u_velocity"])


@pytest.mark.parametrize("name", OPTIMIZERS.keys())
def test_every_optimizer_first_update_is_scaled(name):
    make_opt = OPTIMIZERS[name]
    # with gradient accumulation the first update happens at the second step
    steps = make_opt().gradient_accumulation_steps or 1
    dw, du, _ = linear_steps(ff.Plan([ff.train("u", lr_scale=0.25)]), make_opt, steps=steps)
    assert np.abs(dw).max() > 1e-3  # a real step to compare, not two zero steps
    np.testing.assert_allclose(du, 0.25 * dw, rtol=1e-5, atol=ATOL)


def test_composes_with_a_learning_rate_schedule():
    sched = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    w, u = variables()
    frz = ff.Freezer([w, u], ff.Plan([ff.train("u", lr_scale=0.1)]))
    opt = frz.wrap(keras.optimizers.SGD(sched))
    g = keras.ops.ones((4, 3))
    for step in range(3):
        w0, u0 = w.numpy().copy(), u.numpy().copy()
        opt.apply_gradients([(g, w), (g, u)])
        np.testing.assert_allclose(w0 - w.numpy(), 0.5 * 0.5**step, rtol=1e-6)
        np.testing.assert_allclose(u0 - u.numpy(), 0.1 * 0.5 * 0.5**step, rtol=1e-5, atol=ATOL)


@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_partial_variable_with_two_scales_and_frozen_rows(strategy):
    plan = ff.Plan([ff.freeze("w"), ff.train("w[0]"), ff.train("w[1]", lr_scale=0.5), ff.train("u", lr_scale=2.0)])
    adamw = lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)  # noqa: E731
    # one step: weight decay makes later steps depend on how far each row already moved
    dw, du, opt = linear_steps(plan, adamw, steps=1, strategy=strategy)
    assert np.array_equal(dw[2:], np.zeros_like(dw[2:]))  # frozen rows: not one bit moved
    ref, _, _ = linear_steps(ff.Plan([ff.freeze("u")]), adamw, steps=1)
    np.testing.assert_allclose(dw[0], ref[0], rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(dw[1], 0.5 * ref[1], rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(du, 2.0 * ref, rtol=1e-5, atol=ATOL)
    assert opt._layout.by_path("w").kind == strategy


def test_changing_lr_scale_takes_effect_without_rebuilding():
    w, u = variables()
    frz = ff.Freezer([w, u], ff.Plan([ff.train("u", lr_scale=0.5)]))
    opt = frz.wrap(keras.optimizers.SGD(1.0))
    opt.apply_gradients([(keras.ops.ones((4, 3)), w), (keras.ops.ones((4, 3)), u)])
    inner = opt.inner_optimizer
    frz.update(ff.Plan([ff.train("u", lr_scale=0.25)]))
    assert opt.inner_optimizer is inner and frz.history[-1]["retraced"] is False
    u0 = u.numpy().copy()
    opt.apply_gradients([(keras.ops.ones((4, 3)), w), (keras.ops.ones((4, 3)), u)])
    np.testing.assert_allclose(u0 - u.numpy(), 0.25, rtol=1e-6)


def test_lr_scale_survives_save_and_load(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")], name="net"
    )
    plan = ff.Plan([ff.train("**/a/kernel[:2]", lr_scale=0.1), ff.train("**/b/**", lr_scale=3.0)])
    frz = ff.Freezer(model, plan)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = np.random.default_rng(0).normal(size=(16, 5)), np.random.default_rng(1).normal(size=(16, 2))
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    model.fit(x, y, epochs=2, verbose=0, shuffle=False)
    loaded.fit(x, y, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(weights_of(model), weights_of(loaded)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
