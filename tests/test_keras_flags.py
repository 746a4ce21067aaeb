"""Keras' own switch after a Freezer: ``base.trainable = True`` (the keras.io recipe) is honoured, and said."""

import keras
import numpy as np
import pytest

import finefreeze as ff


def nested(seed=3):
    """The keras.io pattern on a small scale: a backbone model built alone, called inside a new model."""
    keras.utils.set_random_seed(seed)
    base = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, name="d0"), keras.layers.Dense(8, name="d1")], name="backbone"
    )
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(2, name="head")(base(inputs))
    return keras.Model(inputs, outputs, name="clf"), base


X = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")


def test_a_frozen_backbone_is_switched_off_the_keras_way():
    model, base = nested()
    ff.Freezer(model, ff.Plan([ff.freeze(base)]))
    assert base.trainable is False and base.get_layer("d0").kernel.trainable is False
    assert model.get_layer("head").trainable is True
    ff.Freezer(model, ff.Plan([ff.freeze("backbone/d0/**")]))  # a plan change switches it back on
    assert (
        base.trainable is True and not base.get_layer("d0").kernel.trainable and base.get_layer("d1").kernel.trainable
    )


@pytest.mark.slow
def test_unfreezing_the_backbone_with_keras_is_honoured_and_equals_plain_keras():
    model, base = nested()
    ref, ref_base = nested()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("backbone/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    model.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    ref_base.trainable = False
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ref.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    # the keras.io fine-tuning step, on both
    base.trainable = True
    ref_base.trainable = True
    with pytest.warns(
        ff.FreezeWarning, match=r"backbone.trainable = True: the plan now ends with train\('backbone/\*\*'\)"
    ):
        opt = frz.wrap(keras.optimizers.Adam(1e-3))
    assert frz.plan.rules[-1] == ff.train("backbone/**") and len(frz.history) == 2
    model.compile(optimizer=opt, loss="mse")
    ref.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    ref.fit(X, Y, batch_size=8, verbose=0, shuffle=False)
    for a, b in zip(ref.weights, model.weights):
        assert np.array_equal(a.numpy(), b.numpy()), a.path


def test_switching_a_backbone_off_with_keras_freezes_it():
    model, base = nested()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("backbone/d0/**")]))
    base.trainable = False
    with pytest.warns(
        ff.FreezeWarning, match=r"backbone.trainable = False: the plan now ends with freeze\('backbone/\*\*'\)"
    ):
        frz.wrap(keras.optimizers.SGD(0.1))
    assert [v.path for v in frz.trainable_variables] == ["head/kernel", "head/bias"]


def test_no_switch_no_warning_and_variables_keras_did_not_train_stay_so():
    model, base = nested()
    base.get_layer("d1").bias.trainable = False  # the user's own choice before any Freezer
    frz = ff.Freezer(model, ff.Plan([ff.freeze(base)]))
    frz.update(ff.Plan([ff.freeze("head/**")]))  # the backbone's layer flag goes False, then True
    assert base.get_layer("d1").bias.trainable is False and base.get_layer("d1").kernel.trainable
    frz.wrap(keras.optimizers.Adam())  # warnings are errors in this suite
    assert frz.variable_state("backbone/d1/bias") == "untrained"


@pytest.mark.parametrize("then", ["wrap", "update", "activate"])
def test_model_trainable_true_after_a_freezer_is_said_and_the_plan_holds(then):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, name="d0"), keras.layers.Dense(2, name="head")], name="flat"
    )
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/d0/**")]))
    kernel = model.get_layer("d0").kernel
    before = kernel.numpy().copy()
    model.trainable = True  # turns every variable flag on, d0's too; no layer flag records it
    if keras.backend.backend() == "tensorflow":  # Keras' setter leaves the variable flags there: nothing changed
        assert kernel.trainable is False
        kernel.trainable = model.get_layer("d0").bias.trainable = True  # what the setter does on JAX and PyTorch
    assert kernel.trainable is True
    with pytest.warns(ff.FreezeWarning, match=r"turned back on for 2 variable\(s\) the plan freezes .*d0/kernel"):
        if then == "update":
            frz.update(frz.plan)
        elif then == "activate":
            frz.activate()
        model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    assert kernel.trainable is False  # set back: Keras computes no gradient for it
    model.fit(X, Y, epochs=2, verbose=0)
    assert np.array_equal(kernel.numpy(), before)
    assert frz.variable_state("flat/d0/kernel") == "frozen"


@pytest.mark.parametrize("then", ["update", "activate"])
def test_a_backbone_switched_on_after_a_freezer_is_honoured_by_update_and_activate(then):
    """``base.trainable = True`` is a rule at the end of the plan, said with a warning, whichever call comes next."""
    keras.utils.set_random_seed(3)
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="d0")], name="base")
    model = keras.Sequential([keras.Input((6,)), base, keras.layers.Dense(2, name="head")], name="m")
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/base/**")]))
    assert base.trainable is False
    base.trainable = True
    with pytest.warns(ff.FreezeWarning, match=r"base\.trainable = True: the plan now ends with train\("):
        frz.update(frz.plan) if then == "update" else frz.activate()
    assert frz.variable_state("base/d0/kernel") == "trainable" and repr(frz.plan.rules[-1]).startswith("train(")
