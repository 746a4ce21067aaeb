"""Train only x[0, 0] and x[1, 1] of a 2x2 variable; the other two elements never move.

Run: python examples/train_two_elements.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402

x = keras.Variable(np.array([[1.0, 2.0], [3.0, 4.0]], "float32"), name="x")
frz = ff.Freezer([x], ff.Plan([ff.freeze("x"), ff.train("x", indices=[(0, 0), (1, 1)])]))
opt = frz.wrap(keras.optimizers.AdamW(0.1, weight_decay=0.1))  # weight decay would move frozen elements
before = x.numpy().copy()
for _ in range(50):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(x.value))  # pulls every element toward 0
    opt.apply_gradients([(tape.gradient(loss, x.value), x)])
print("before:\n", before, "\nafter:\n", x.numpy())
print(frz.summary())
assert np.array_equal(x.numpy()[[0, 1], [1, 0]], before[[0, 1], [1, 0]])  # x[0,1], x[1,0]: bit-identical
assert abs(x.numpy()[0, 0]) < 0.5 and abs(x.numpy()[1, 1]) < 1.0  # x[0,0], x[1,1]: trained
frz.verify()
print("OK: x[0,0] and x[1,1] trained, x[0,1] and x[1,0] bit-identical")
