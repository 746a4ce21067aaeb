"""Plan(batchnorm=...): frozen, train (Lightning's train_bn), stats; each equal to its hand-written Keras recipe."""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of

X = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")


def convnet(seed=5):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = inp
    for i in range(2):
        x = keras.layers.Conv2D(4, 3, padding="same", name=f"block{i}_conv")(x)
        x = keras.layers.BatchNormalization(name=f"block{i}_bn")(x)
        x = keras.layers.ReLU(name=f"block{i}_relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="net")


def bns(model):
    return [x for x in model.layers if isinstance(x, keras.layers.BatchNormalization)]


def fit(model, optimizer):
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def same(a, b):
    for va, vb in zip(weights_of(a), weights_of(b)):
        assert np.array_equal(va.numpy(), vb.numpy()), va.path


def test_frozen_is_keras_bn_trainable_false():
    ref, model = convnet(), convnet()
    for bn in bns(ref):
        bn.trainable = False
    fit(ref, keras.optimizers.Adam(1e-2))
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    frz = ff.Freezer(model, ff.Plan([], batchnorm="frozen"))
    fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    same(ref, model)
    assert all(np.array_equal(v.numpy(), before[v.path]) for bn in bns(model) for v in weights_of(bn))
    frz.verify()
    assert "batchnorm='frozen'" in frz.summary() and frz.report()["batchnorm"].startswith("BatchNormalization")


def test_train_keeps_batchnorm_training_inside_a_frozen_backbone():
    ref, model = convnet(), convnet()
    for layer in ref.layers:
        layer.trainable = isinstance(layer, keras.layers.BatchNormalization) or layer.name == "head"
    fit(ref, keras.optimizers.Adam(1e-2))
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("head/**")], batchnorm="train"))
    fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    same(ref, model)
    assert frz.variable_state("block0_bn/gamma") == "trainable" and frz.variable_state("block0_conv/kernel") == "frozen"


def test_stats_freezes_gamma_beta_and_keeps_updating_statistics():
    ref, model = convnet(), convnet()
    for bn in bns(ref):
        bn.gamma.trainable = bn.beta.trainable = False
    fit(ref, keras.optimizers.Adam(1e-2))
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    frz = ff.Freezer(model, ff.Plan([], batchnorm="stats"))
    fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    same(ref, model)
    bn = model.get_layer("block0_bn")
    assert np.array_equal(bn.gamma.numpy(), before[bn.gamma.path])
    assert not np.array_equal(bn.moving_mean.numpy(), before[bn.moving_mean.path])
    frz.verify()


def test_the_option_is_checked_and_saved():
    with pytest.raises(ff.PlanError, match=r"Plan\(batchnorm='inference'\): choose one of 'keras', 'frozen'"):
        ff.Plan([], batchnorm="inference")
    plan = ff.Plan([ff.freeze("**"), ff.train("head/**")], batchnorm="stats")
    assert ff.Plan.from_dict(plan.to_dict()) == plan != ff.Plan(plan.rules)
    assert plan.train("x/**").batchnorm == "stats" and repr(plan).endswith("batchnorm='stats')")
    with pytest.raises(ff.PlanError, match="'batchnorm' must be one of"):
        ff.Plan.from_dict({"rules": [], "batchnorm": 1})
    ff.Freezer(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]), ff.Plan([], batchnorm="frozen"))


class InferenceBatchNorm(keras.layers.BatchNormalization):
    """The hand-written recipe for 'affine': a BatchNormalization that always runs in inference mode.

    (Calling the layer with training=False in a Functional model does not do it: Keras 3 passes
    fit's training=True through.)"""

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=False, mask=mask)


def convnet_inference_bn(seed=5):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = inp
    for i in range(2):
        x = keras.layers.Conv2D(4, 3, padding="same", name=f"block{i}_conv")(x)
        x = InferenceBatchNorm(name=f"block{i}_bn")(x)
        x = keras.layers.ReLU(name=f"block{i}_relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="net")


def test_affine_trains_gamma_beta_in_inference_mode():
    ref, model = convnet_inference_bn(), convnet()
    for layer in ref.layers:
        layer.trainable = isinstance(layer, keras.layers.BatchNormalization) or layer.name == "head"
    stats = {v.path: v.numpy().copy() for bn in bns(ref) for v in bn.non_trainable_weights}
    fit(ref, keras.optimizers.Adam(1e-2))
    assert all(np.array_equal(v.numpy(), stats[v.path]) for bn in bns(ref) for v in bn.non_trainable_weights)
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("head/**")], batchnorm="affine"))
    fit(model, frz.wrap(keras.optimizers.Adam(1e-2)))
    same(ref, model)
    assert not np.array_equal(model.get_layer("block0_bn").gamma.numpy(), np.ones(4, "float32"))
    frz.update(ff.Plan([ff.freeze("**"), ff.train("head/**")]))  # back to Keras' BatchNorm
    assert "call" not in model.get_layer("block0_bn").__dict__


def test_gradual_unfreezing_keeps_the_plans_batchnorm_option():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,))]
    for i in range(3):
        layers += [keras.layers.Dense(4, name=f"block{i}"), keras.layers.BatchNormalization(name=f"block{i}_bn")]
    m = keras.Sequential([*layers, keras.layers.Dense(2, name="head")], name="m")
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**")], batchnorm="frozen"))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.05)), loss="mse")
    bn = {v.path: np.array(v.numpy(), copy=True) for v in weights_of(m) if "_bn/" in v.path}
    kernel = np.array(m.get_layer("block2").kernel.numpy(), copy=True)
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    cb = ff.callbacks.GradualUnfreezing(["**/block2*/**", "**/block1*/**"])
    m.fit(x, np.ones((16, 2), "float32"), epochs=3, batch_size=8, verbose=0, callbacks=[cb])
    assert frz.plan.batchnorm == "frozen"
    assert all(np.array_equal(bn[p], v.numpy()) for p, v in ((v.path, v) for v in weights_of(m) if v.path in bn))
    assert not np.array_equal(m.get_layer("block2").kernel.numpy(), kernel)  # released: trained
    frz.verify()
