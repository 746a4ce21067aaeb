"""TensorFlow's own objects under a plan: a ``tf.Module`` and raw ``tf.Variable`` objects, in custom loops."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import finefreeze as ff
from conftest import TwoLayerModule

pytestmark = pytest.mark.backends("tensorflow", reason="tf.Module and raw tf.Variable objects")


def test_tf_module_custom_loop():
    mod = TwoLayerModule()
    frz = ff.Freezer(mod, ff.Plan([ff.freeze("layers/0/w[0]"), ff.freeze("scale")]))
    w0 = mod.layers[0]["w"].numpy().copy()
    opt = frz.wrap(keras.optimizers.Adam(0.1))
    x, y = tf.random.normal((8, 3)), tf.random.normal((8, 2))
    for _ in range(3):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(frz.trainable_variables)
            loss = tf.reduce_mean(tf.square(mod(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, frz.trainable_variables), frz.trainable_variables))
    assert np.array_equal(mod.layers[0]["w"].numpy()[0], w0[0])
    assert not np.array_equal(mod.layers[0]["w"].numpy()[1:], w0[1:])
    assert mod.scale.numpy() == 1.0
    frz.verify()


@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_raw_tf_variables_in_a_custom_loop(strategy):
    w = tf.Variable(np.arange(12, dtype="float32").reshape(3, 4), name="w")
    b = tf.Variable(np.zeros(4, "float32"), name="b")
    frz = ff.Freezer([w, b], ff.Plan([ff.freeze("w[1:]"), ff.freeze("b")]), strategy=strategy)
    assert frz.trainable_variables == [w]
    opt = frz.wrap(keras.optimizers.Adam(0.1, weight_decay=0.1))
    before = w.numpy().copy()
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(w + b))
        opt.apply_gradients(zip(tape.gradient(loss, frz.trainable_variables), frz.trainable_variables))
    assert np.array_equal(w.numpy()[1:], before[1:])
    assert not np.array_equal(w.numpy()[0], before[0])
    assert np.array_equal(b.numpy(), np.zeros(4, "float32"))
    frz.verify()


def test_tf_module_name_and_attribute_paths():
    mod = TwoLayerModule()
    frz = ff.Freezer(mod, ff.Plan([ff.freeze("layers/0/**"), ff.freeze("scale")]))
    # names 'w' and 'b' are shared by two variables each: attribute paths identify them
    tv = frz.trainable_variables
    assert {id(v) for v in tv} == {id(mod.layers[1]["w"]), id(mod.layers[1]["b"])}
    assert frz.variable_state("layers/0/w") == "frozen"
    assert mod.layers[0]["w"].trainable  # raw tf.Variables keep their flag
    with pytest.raises(ff.PlanError, match="selects nothing"):
        ff.Freezer(mod, ff.Plan([ff.freeze("w")]))
