"""Freeze one layer three ways: tf.stop_gradient, var_list, and a finefreeze plan.

All three train the same weights; they differ in what they cost and in how
easy they are to get wrong. Run: python examples/freeze_a_layer_three_ways.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402

x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
y = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", name="backbone"),
            keras.layers.Dense(2, name="head"),
        ],
        name="net",
    )


def train(m, variables, opt, stop_gradient=False, steps=20):
    opt.build(variables)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            h = m.get_layer("backbone")(x)
            if stop_gradient:
                h = tf.stop_gradient(h)
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, m.get_layer("head")(h)))
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
    state = sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape))  # slots, not step counters
    return [v.numpy() for v in m.weights], state


# 1. tf.stop_gradient: the backbone gets no gradient, but Adam still makes slots for it.
m1 = model()
w1, slots1 = train(m1, m1.trainable_variables, keras.optimizers.Adam(0.01), stop_gradient=True)

# 2. var_list: only the head is passed (a typo in a name list silently trains nothing or everything).
m2 = model()
w2, slots2 = train(m2, m2.get_layer("head").trainable_variables, keras.optimizers.Adam(0.01))

# 3. a plan: declarative, checked (a typo is a PlanError), reported, verifiable.
m3 = model()
frz = ff.Freezer(m3, ff.Plan([ff.freeze("**/backbone/**")]))
w3, slots3 = train(m3, frz.trainable_variables, frz.wrap(keras.optimizers.Adam(0.01)))
frz.verify()

print(f"Adam state elements: stop_gradient {slots1}, var_list {slots2}, plan {slots3}")
for a, b, c in zip(w1, w2, w3):
    assert np.array_equal(a, b) and np.array_equal(b, c)
head = 16 * 2 + 2
assert slots2 == slots3 == 2 * head and slots1 == 2 * (8 * 16 + 16 + head)
print("OK: the three recipes trained bit-identical weights; the plan paid state only for the head")
