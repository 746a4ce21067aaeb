"""One test body over every Keras optimizer x exact strategy x execution mode:
frozen elements are bit-identical after training, trainable ones moved."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

import finefreeze as ff
from optimizers import OPTIMIZERS, WRAPPERS

STEPS = 4


def test_every_keras_optimizer_is_covered():
    classes = {
        n for n, c in vars(keras.optimizers).items() if inspect.isclass(c) and issubclass(c, keras.optimizers.Optimizer)
    }
    covered = {type(make()).__name__ for make in OPTIMIZERS.values()}
    assert classes - WRAPPERS <= covered, classes - WRAPPERS - covered


def make_problem():
    rng = np.random.default_rng(0)
    w = keras.Variable(rng.normal(size=(6, 4)).astype("float32"), name="w")
    b = keras.Variable(rng.normal(size=(4,)).astype("float32"), name="bias")
    v = keras.Variable(rng.normal(size=(4, 3)).astype("float32"), name="v")
    x = tf.constant(rng.normal(size=(16, 6)).astype("float32"))
    y = tf.constant(rng.normal(size=(16, 3)).astype("float32"))
    mask = rng.random((6, 4)) < 0.5
    plan = ff.Plan([ff.freeze("v"), ff.freeze("w", mask=mask)])
    return [w, b, v], x, y, plan


def loss_fn(ws, x, y):
    w, b, v = ws
    return tf.reduce_mean(tf.square(tf.tanh(x @ w + b) @ v - y))


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_frozen_elements_bit_identical(name, strategy, mode):
    ws, x, y, plan = make_problem()
    before = [np.array(v.numpy(), copy=True) for v in ws]
    frz = ff.Freezer(ws, plan, strategy=strategy)
    opt = frz.wrap(OPTIMIZERS[name]())
    tvars = frz.trainable_variables
    assert [v.path for v in tvars] == ["w", "bias"]
    opt.build(tvars)

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(ws, x, y)
        grads = tape.gradient(loss, tvars)
        opt.apply_gradients(zip(grads, tvars))

    if mode != "eager":
        step = tf.function(step, jit_compile=(mode == "xla"))
    for _ in range(STEPS):
        step()
    opt.finalize_variable_values(tvars)

    frozen = frz.frozen_mask("w")
    w, b, v = (np.asarray(t.numpy()) for t in ws)
    assert np.array_equal(w[frozen], before[0][frozen])  # partially frozen: bit-identical
    assert np.array_equal(v, before[2])  # fully frozen: bit-identical
    assert not np.array_equal(w[~frozen], before[0][~frozen])  # trainable elements moved
    assert not np.array_equal(b, before[1])
    frz.verify()
    # fully frozen variables never reach the inner optimizer: no state for them
    slot_names = [var.path.rsplit("/", 1)[-1] for var in opt.inner_optimizer.variables]
    assert not any(n.startswith("v_") for n in slot_names), slot_names
    if strategy == "compact" and name != "multi_optimizer":
        sizes = [int(np.prod(var.shape)) for var in opt.inner_optimizer.variables if "w" in var.path]
        assert all(s <= int((~frozen).sum()) for s in sizes)  # slots hold trainable elements only
