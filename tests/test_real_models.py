"""Real architectures as practitioners use them: nested backbones as scopes, blocks, a grouped summary."""

import types

import keras
import numpy as np
import pytest

import finefreeze as ff
from backbones import mobilenet, transformer_backbone
from backend_utils import weights_of
from finefreeze._resolve.scopes import drop_ambiguous_aliases


def resnet50():
    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10)


# -- 1. a nested model's name is a scope ----------------------------------------------------
def test_a_nested_backbone_is_a_scope():
    model, base = mobilenet()
    assert not any(v.path.startswith(base.name + "/") for v in weights_of(model))  # Keras leaves the name out
    frz = ff.Freezer(model, ff.Plan([ff.freeze(f"{base.name}/**")]))
    by_instance = ff.Freezer(model, ff.Plan([ff.freeze(base)]))
    assert [v.path for v in frz.trainable_variables] == ["head/kernel", "head/bias"]
    assert [v.path for v in frz.trainable_variables] == [v.path for v in by_instance.trainable_variables]
    assert frz.frozen_mask(f"{base.name}/Conv1/kernel").all()  # the scoped name is an alias
    rep = frz.report()
    assert "Conv1/kernel" in {v["path"] for v in rep["variables"]}  # the real Keras path stays the path
    conv = ff.Freezer(model, ff.Plan([ff.freeze(f"{base.name}/Conv1/kernel[0]")]))
    assert conv.variable_state("Conv1/kernel") == "partial"


def test_a_scope_that_selects_nothing_names_the_closest_paths():
    model, base = mobilenet()
    with pytest.raises(ff.PlanError, match=r"rule 1 freeze\('mobilenetv2_0.35_33/\*\*'\) selects nothing"):
        ff.Freezer(model, ff.Plan([ff.freeze("mobilenetv2_0.35_33/**")]))


def test_an_ambiguous_scoped_name_is_dropped_and_explained():
    def info(path, *aliases):
        return types.SimpleNamespace(path=path, names=(path, *aliases))

    infos = [info("d/kernel", "enc/d/kernel"), info("enc/d/kernel"), info("e/kernel", "enc/e/kernel")]
    bad = drop_ambiguous_aliases(infos)
    assert bad == {"enc/d/kernel": ["d/kernel", "enc/d/kernel"]}
    assert infos[0].names == ("d/kernel",) and infos[2].names == ("e/kernel", "enc/e/kernel")


@pytest.mark.slow
def test_training_a_head_over_a_scoped_backbone_equals_keras_trainable_false():
    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(8, 1)).astype("float32")
    keras.utils.set_random_seed(7)
    ref, ref_base = mobilenet()
    keras.utils.set_random_seed(7)
    model, base = mobilenet()
    for a, b in zip(weights_of(ref), weights_of(model)):
        assert np.array_equal(a.numpy(), b.numpy())
    ref_base.trainable = False
    ref.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    ref.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    frz = ff.Freezer(model, ff.Plan([ff.freeze(f"{base.name}/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(weights_of(ref), weights_of(model)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), weights_of(ref_base)[0].numpy()[:1])
    frz.verify()


# -- 5. blocks --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="block structure of models, the same on every backend")
def test_blocks_of_real_architectures():
    rn = ff.blocks(resnet50())
    assert [b.name for b in rn][:4] == ["conv2_block1", "conv2_block2", "conv2_block3", "conv3_block1"]
    assert len(rn) == 16 and [b.stage for b in rn].count("conv4") == 6
    eff = ff.blocks(keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, include_top=False))
    assert len(eff) == 16 and eff[0].name == "block1a" and eff[-1].name == "block7a" and eff[2].stage == "block2"
    _, base = mobilenet()
    mb = ff.blocks(base)
    assert [b.name for b in mb] == [f"block_{i}" for i in range(1, 17)]
    tf = ff.blocks(transformer_backbone(layers=3))
    assert [b.name for b in tf] == ["transformer_layer_0", "transformer_layer_1", "transformer_layer_2"]
    assert ff.blocks(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])) == ()


@pytest.mark.slow
def test_the_last_two_blocks_train_and_nothing_else():
    model = resnet50()
    last = ff.blocks(model)[-2:]
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train(last), ff.train("predictions/**")]))
    expected = {"predictions/kernel", "predictions/bias"}
    for layer in model.layers:
        if layer.name.startswith(("conv5_block2_", "conv5_block3_")):
            expected |= {v.path for v in layer.trainable_weights}
    assert {v.path for v in frz.trainable_variables} == expected
    assert ff.Plan.from_dict(frz.plan.to_dict()) == frz.plan  # a block selector is a plan-file string


def test_a_nested_backbone_blocks_select_through_the_scope():
    model, base = mobilenet()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train(ff.blocks(base)[-1]), ff.train("head/**")]))
    got = {v.path for v in frz.trainable_variables}
    assert got == {v.path for v in base.trainable_weights if v.path.startswith("block_16_")} | {
        "head/kernel",
        "head/bias",
    }


@pytest.mark.slow
def test_gradual_unfreezing_by_blocks():
    model = transformer_backbone(layers=3)
    blocks = ff.blocks(model)
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("**/pooled_dense/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-3)), loss="mse")
    seen = []
    cb = ff.callbacks.GradualUnfreezing(list(reversed(blocks[-2:])))
    probe = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.append({v.path.split("/")[0] for v in frz.trainable_variables})
    )
    x = np.random.default_rng(0).integers(0, 50, (4, 8)).astype("int32")
    model.fit(x, np.zeros((4, 16)), epochs=3, verbose=0, callbacks=[cb, probe])
    assert seen == [
        {"pooled_dense"},
        {"pooled_dense", "transformer_layer_2"},
        {"pooled_dense", "transformer_layer_2", "transformer_layer_1"},
    ]
    frz.verify()


def test_an_empty_slice_of_blocks_is_a_plan_error():
    with pytest.raises(ff.PlanError, match="empty list of blocks"):
        ff.train(ff.blocks(transformer_backbone(layers=2))[5:])


# -- 4. a summary that reads on ResNet50 --------------------------------------------------------
def test_resnet50_summary_is_grouped_narrow_and_short():
    model = resnet50()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train(ff.blocks(model)[-2:]), ff.train("predictions/**")]))
    text = frz.summary()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120 and len(lines) <= 25, text
    row = next(line for line in lines if line.startswith("conv4_block1…6"))
    assert "frozen" in row and "7.1 M" in row
    assert " trainable " in next(line for line in lines if line.startswith("conv5_block2…3"))
    detail = frz.summary(detail=True)
    assert len(detail.splitlines()) > 300 and "conv4_block6_3_conv" in detail
    rep = frz.report()
    assert len(rep["variables"]) == len(weights_of(model)) and [g["name"] for g in rep["groups"]][-1] == "predictions"
    assert sum(g["frozen_elements"] for g in rep["groups"]) == rep["totals"]["frozen_elements"]


def test_a_small_model_keeps_the_detailed_table_by_default():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="a")], name="m")
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/kernel[0]")]))
    assert frz.summary() == frz.summary(detail=True) != frz.summary(detail=False)


@pytest.mark.parametrize(
    "make, label, slots",
    [
        (lambda: keras.optimizers.SGD(0.1), "SGD state", 0),
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), "SGD state", 1),
        (lambda: keras.optimizers.Adam(amsgrad=True), "Adam state", 3),
        (lambda: keras.optimizers.AdamW(use_ema=True), "AdamW state", 3),
    ],
)
def test_the_state_column_is_the_wrapped_optimizers(make, label, slots):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")])
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/**")]))
    model.compile(optimizer=frz.wrap(make()), loss="mse")
    model.fit(np.ones((2, 3)), np.ones((2, 2)), verbose=0)
    rep = frz.report()
    assert rep["optimizer_state"] == label and label in frz.summary(detail=False)
    inner = model.optimizer.inner_optimizer
    per_var = sum(int(np.prod(v.shape)) for v in inner.variables if len(v.shape) and v.shape != ())
    assert rep["totals"]["optimizer_state_elements"] == slots * 10 == per_var
