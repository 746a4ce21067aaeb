"""One test body over every Keras optimizer x exact strategy x execution mode.

Each run has a warm phase: everything trains for a few steps (momentum,
EMA averages, accumulators fill up), then part of the model is frozen with
``Freezer.update`` and training goes on. Frozen elements must be
bit-identical from the moment of freezing, and trainable ones must equal an
independent reference: the inner optimizer alone, fed gradients selected
with ``where`` and with the frozen elements put back after every step by the
test itself.
"""

import functools
import inspect

import keras
import numpy as np
import pytest
from keras import ops

import finefreeze as ff
from backend_utils import COMPILED, MODES, gradients, strategy_of, train_step
from optimizers import OPTIMIZERS, WRAPPERS

WARM, STEPS = 3, 4
# A mask with a fully frozen row and column: the Adafactor refusal needs it, and
# elementwise optimizers must not care.
MASK = np.random.default_rng(5).random((6, 4)) < 0.5
MASK[0, :] = True
MASK[:, 0] = True
NOT_ELEMENTWISE = {"adafactor", "lamb", "muon", "schedule_free_adamw", "multi_optimizer"}


def test_every_keras_optimizer_is_covered():
    classes = {
        n for n, c in vars(keras.optimizers).items() if inspect.isclass(c) and issubclass(c, keras.optimizers.Optimizer)
    }
    covered = {type(make()).__name__ for make in OPTIMIZERS.values()}
    assert classes - WRAPPERS <= covered, classes - WRAPPERS - covered


def make_problem(seed=0):
    rng = np.random.default_rng(seed)
    w = keras.Variable(rng.normal(size=(6, 4)).astype("float32"), name="w")
    b = keras.Variable(rng.normal(size=(4,)).astype("float32"), name="bias")
    v = keras.Variable(rng.normal(size=(4, 3)).astype("float32"), name="v")
    x = ops.convert_to_tensor(rng.normal(size=(16, 6)).astype("float32"))
    y = ops.convert_to_tensor(rng.normal(size=(16, 3)).astype("float32"))
    return [w, b, v], x, y


FROZEN_PLAN = ff.Plan([ff.freeze("v"), ff.freeze("w", mask=MASK)])


def loss_fn(ws, x, y):
    w, b, v = ws
    return ops.mean(ops.square(ops.matmul(ops.tanh(ops.matmul(x, w) + b), v) - y))


def runner(opt, variables, ws, x, y, mode):
    return train_step(opt, variables, lambda: loss_fn(ws, x, y), mode)


@functools.cache
def reference_run(name, mode):
    """The inner optimizer alone: warm phase on everything, then where-selected gradients and write-back."""
    ws, x, y = make_problem()
    opt = OPTIMIZERS[name]()
    opt.build(ws)
    step = runner(opt, ws, ws, x, y, mode)
    for _ in range(WARM):
        step()
    held = [np.array(t.numpy(), copy=True) for t in ws]
    frozen = [MASK, None, np.ones((4, 3), bool)]

    def masked_step():
        grads = gradients(lambda: loss_fn(ws, x, y), ws)
        grads = [g if m is None else ops.where(m, ops.zeros_like(g), g) for g, m in zip(grads, frozen)]
        opt.apply_gradients(zip(grads, ws))

    def put_back():
        for t, h, m in zip(ws, held, frozen):
            if m is not None:
                t.assign(np.where(m, h, t.numpy()))

    for _ in range(STEPS):
        masked_step()
        put_back()
    opt.finalize_variable_values(ws)
    put_back()
    return [np.asarray(t.numpy()) for t in ws]


@pytest.mark.parametrize("mode", [pytest.param(m, marks=() if m == COMPILED else pytest.mark.slow) for m in MODES])
@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_frozen_elements_bit_identical_after_a_warm_phase(name, strategy, mode):
    if strategy == "compact" and name in NOT_ELEMENTWISE:
        ws, _, _ = make_problem()
        with pytest.raises(ff.PlanError, match="strategy='compact' would change the optimizer's maths"):
            ff.Freezer(ws, FROZEN_PLAN, strategy="compact").wrap(OPTIMIZERS[name]())
        return
    ws, x, y = make_problem()
    frz = ff.Freezer(ws, ff.Plan(), strategy=strategy)  # warm phase: everything trains
    opt = frz.wrap(OPTIMIZERS[name]())
    opt.build(frz.trainable_variables)
    step = runner(opt, frz.trainable_variables, ws, x, y, mode)
    for _ in range(WARM):
        step()
    if name == "adafactor":  # a fully frozen row and column: Adafactor would go to NaN
        with pytest.raises(ff.PlanError, match="Adafactor would turn training into NaN"):
            frz.update(FROZEN_PLAN)
        assert frz.plan == ff.Plan() and opt._layout.kinds() == {"w": "train", "bias": "train", "v": "train"}
        return
    frz.update(FROZEN_PLAN)
    at_freeze = [np.array(t.numpy(), copy=True) for t in ws]
    assert [v.path for v in frz.trainable_variables] == ["w", "bias"]
    step = runner(opt, frz.trainable_variables, ws, x, y, mode)
    for _ in range(STEPS):
        step()
    opt.finalize_variable_values(frz.trainable_variables)

    w, b, v = (np.asarray(t.numpy()) for t in ws)
    assert np.array_equal(w[MASK], at_freeze[0][MASK])  # partially frozen: bit-identical
    assert np.array_equal(v, at_freeze[2])  # fully frozen: bit-identical
    frz.verify()
    assert strategy_of(frz, "w") == strategy
    # fully frozen variables never reach the inner optimizer: no state for them after the change
    slot_names = [var.path.rsplit("/", 1)[-1] for var in opt.inner_optimizer.variables]
    assert not any(n.startswith("v_") for n in slot_names), slot_names
    if strategy == "compact":
        sizes = [int(np.prod(var.shape)) for var in opt.inner_optimizer.variables if "w." in var.path]
        assert sizes or name == "sgd"  # plain SGD keeps no state
        assert all(s == int((~MASK).sum()) for s in sizes)  # state for trainable elements only
    # trainable elements: the independent reference
    ref_w, ref_b, _ = reference_run(name, mode)
    np.testing.assert_allclose(w[~MASK], ref_w[~MASK], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(b, ref_b, rtol=2e-6, atol=1e-7)


ELEMENTWISE_NAMES = sorted(set(OPTIMIZERS) - NOT_ELEMENTWISE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ELEMENTWISE_NAMES)
def test_compact_and_restore_train_the_same_values(name):
    """Where compact is allowed it changes cost, never maths: both strategies give the same weights."""
    out = {}
    for strategy in ("restore", "compact"):
        ws, x, y = make_problem(seed=3)
        frz = ff.Freezer(ws, ff.Plan(), strategy=strategy)
        opt = frz.wrap(OPTIMIZERS[name]())
        step = runner(opt, frz.trainable_variables, ws, x, y, COMPILED)
        for _ in range(WARM):
            step()
        frz.update(FROZEN_PLAN)
        step = runner(opt, frz.trainable_variables, ws, x, y, COMPILED)
        for _ in range(STEPS):
            step()
        opt.finalize_variable_values(frz.trainable_variables)
        out[strategy] = [np.asarray(t.numpy()) for t in ws]
    for a, b in zip(out["restore"], out["compact"]):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
