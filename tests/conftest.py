"""Shared fixtures: real Keras models of every kind the plans must resolve on.

Which Keras backend runs which test is ``tests/keras_backends.py``'s, a plugin
the repository's top ``conftest.py`` loads before this file.
"""

import signal

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()

# The signal tests send Ctrl-C to the commands they run (in this process and in processes it starts), which
# keep ignoring it when they start ignoring it: a suite started with Ctrl-C ignored (`pytest &` in a script)
# hears it as Python does by default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if BACKEND == "tensorflow":
    import tensorflow as tf

    # Three logical CPUs for the tf.distribute tests; must happen before TensorFlow
    # initializes its devices. Ops without a device still run on CPU:0.
    N_LOGICAL_CPUS = 3
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * N_LOGICAL_CPUS
    )

keras.config.disable_interactive_logging()


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


def flags(model):
    """Every trainable flag of a model, layers and variables, to compare."""
    out = {("layer", id(x)): x.trainable for x in model._flatten_layers(include_self=True)}
    out.update({("var", id(v)): v.trainable for v in model.weights})
    return out


def weights(model):
    return {v.path: np.array(v.numpy(), copy=True) for v in model.weights}


def mlp(name="mlp", units=(8, 6, 4), input_dim=5, bn=False):
    layers = [keras.Input((input_dim,))]
    for i, u in enumerate(units[:-1]):
        layers.append(keras.layers.Dense(u, activation="tanh", name=f"dense_{i}"))
        if bn:
            layers.append(keras.layers.BatchNormalization(name=f"bn_{i}"))
    layers.append(keras.layers.Dense(units[-1], name="head"))
    return keras.Sequential(layers, name=name)


def functional():
    inp = keras.Input((6,), name="x")
    shared = keras.layers.Dense(6, name="shared")
    a = shared(inp)
    b = shared(keras.layers.Dense(6, name="pre")(inp))
    h = keras.layers.Concatenate()([a, b])
    out = keras.layers.Dense(3, name="head")(h)
    return keras.Model(inp, out, name="func")


class Block(keras.layers.Layer):
    def __init__(self, d, **kw):
        super().__init__(**kw)
        self.inner = keras.layers.Dense(d, name="inner")
        self.outer = keras.layers.Dense(d, name="outer")

    def call(self, x):
        return self.outer(self.inner(x))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.block_a = Block(4, name="block_a")
        self.block_b = Block(4, name="block_b")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block_b(self.block_a(x)))


def subclassed():
    m = Subclassed()
    m(np.zeros((1, 4), "float32"))
    return m


def nested():
    inner = mlp("backbone", units=(6, 5), input_dim=4)
    inp = keras.Input((4,))
    out = keras.layers.Dense(3, name="head")(inner(inp))
    return keras.Model(inp, out, name="outer")


def transformer(vocab=50, seq=8, d=16, blocks=2, name="tfm"):
    tokens = keras.Input((seq,), dtype="int32")
    from finefreeze._data.text_model import PositionEmbedding

    x = keras.layers.Embedding(vocab, d, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"block_{i}_ln")(x)
        h = keras.layers.MultiHeadAttention(2, d // 2, name=f"block_{i}_attn")(h, h)
        x = x + h
        h = keras.layers.Dense(2 * d, activation="relu", name=f"block_{i}_ff1")(x)
        x = x + keras.layers.Dense(d, name=f"block_{i}_ff2")(h)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(3, name="head")(x)
    return keras.Model(tokens, out, name=name)


if BACKEND == "tensorflow":

    class TwoLayerModule(tf.Module):
        def __init__(self):
            super().__init__(name="net")
            self.layers = [
                {"w": tf.Variable(tf.random.normal((3, 4)), name="w"), "b": tf.Variable(tf.zeros(4), name="b")},
                {"w": tf.Variable(tf.random.normal((4, 2)), name="w"), "b": tf.Variable(tf.zeros(2), name="b")},
            ]
            self.scale = tf.Variable(1.0, name="scale")

        def __call__(self, x):
            for layer in self.layers:
                x = tf.tanh(x @ layer["w"] + layer["b"])
            return x * self.scale
