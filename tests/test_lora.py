"""Plans over LoRA: adapters and sparse elements of the base kernel train together, exactly.

``enable_lora`` switches its layer's base kernel off (``trainable=False``).
That kernel is a plan target, frozen unless a rule trains it; variables Keras
does not train by nature (BatchNorm moving statistics) stay outside plans.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import gradients, weights_of

PLAN = ff.Plan([ff.freeze("**"), ff.train("**/lora_kernel_*"), ff.train("**/d/kernel[:, 1]"), ff.train("**/head/**")])


def lora_model(bn=False):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(6, name="d")(inputs)
    if bn:
        h = keras.layers.BatchNormalization(name="bn")(h)
    out = keras.layers.Dense(3, name="head")(h)
    m = keras.Model(inputs, out, name="m")
    m.get_layer("d").enable_lora(2, b_initializer="glorot_uniform")  # b nonzero: the base kernel gets a gradient too
    return m


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")


def raw(v):
    return np.asarray(keras.ops.convert_to_numpy(v))


def test_the_base_kernel_is_a_plan_target_frozen_unless_a_rule_trains_it():
    m = lora_model(bn=True)
    states = {s.path: s.state for s in ff.Freezer(m, ff.Plan([]))._res.states}
    assert states["d/kernel"] == "frozen"  # Keras' state: enable_lora switched it off
    assert states["d/lora_kernel_a"] == states["d/lora_kernel_b"] == "trainable"
    assert states["bn/moving_mean"] == states["bn/moving_variance"] == "untrained"
    states = {s.path: s.state for s in ff.Freezer(m, PLAN)._res.states}
    assert states["d/kernel"] == "partial" and states["d/bias"] == "frozen"
    with pytest.raises(ff.PlanError, match="Keras does not train"):
        ff.Freezer(m, ff.Plan([ff.train("**/moving_mean")]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.EinsumDense("ab,bc->ac", output_shape=4, name="e"),
        lambda: keras.layers.Embedding(10, 4, name="e"),
    ],
    ids=["EinsumDense", "Embedding"],
)
def test_every_lora_layer_kind_has_its_base_in_plans(make):
    layer = make()
    layer.build((None, 5) if isinstance(layer, keras.layers.EinsumDense) else (None,))
    layer.enable_lora(2)
    base = layer._embeddings if isinstance(layer, keras.layers.Embedding) else layer._kernel
    frz = ff.Freezer(layer, ff.Plan([ff.train(f"{base.path}[0]")]))
    states = {s.path: s.state for s in frz._res.states}
    assert states[base.path] == "partial"


def test_lora_plus_sparse_base_elements_train_as_plain_keras_would():
    x, y = data()
    loss = keras.losses.MeanSquaredError()
    m = lora_model()
    frz = ff.Freezer(m, PLAN, strategy="restore")
    opt = frz.wrap(keras.optimizers.Adam(0.02))
    ref = lora_model()
    frozen_cols = np.ones((8, 6), bool)
    frozen_cols[:, 1] = False
    ref.get_layer("d")._kernel.trainable = True
    train = [
        ref.get_layer("d")._kernel,
        *[v for v in weights_of(ref) if "lora_kernel" in v.path or v.path.startswith("head/")],
    ]
    ref_opt = keras.optimizers.Adam(0.02)
    start = [raw(v) for v in weights_of(m)]
    for _ in range(6):
        variables = frz.trainable_variables
        opt.apply(gradients(lambda: loss(y, m(x, training=True)), variables), variables)
        g = gradients(lambda: loss(y, ref(x, training=True)), train)
        g[0] = keras.ops.where(frozen_cols, keras.ops.zeros_like(g[0]), g[0])
        ref_opt.apply(g, train)
    got = {v.path: raw(v) for v in weights_of(m)}
    want = {v.path: raw(v) for v in weights_of(ref)}
    assert {p: got[p].tobytes() for p in got} == {p: want[p].tobytes() for p in want}
    kernel = got["d/kernel"]
    assert np.array_equal(kernel[frozen_cols], start[0][frozen_cols])  # frozen base elements, to the bit
    assert not np.array_equal(kernel[:, 1], start[0][:, 1])
    frz.verify()


def test_fit_trains_adapters_and_chosen_base_elements_and_nothing_else():
    x, y = data()
    m = lora_model()
    plan = ff.select(
        m, (x, y), budget=0.1, loss="mse", include="**/lora_kernel_*", spread="variable", options={"verbose": 0}
    )
    frz = ff.Freezer(m, plan)
    chosen = {s.path for s in frz._res.states if s.state == "partial"}
    assert "d/kernel" in chosen  # the sparse part may sit in the base kernel under LoRA
    before = {v.path: raw(v) for v in weights_of(m)}
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.01)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    frz.verify()
    mask = frz.frozen_mask("d/kernel")
    kernel = raw(m.get_layer("d")._kernel)
    assert np.array_equal(kernel[mask], before["d/kernel"][mask])
    assert not np.array_equal(kernel[~mask], before["d/kernel"][~mask])
    assert not np.array_equal(raw(m.get_layer("d").lora_kernel_a), before["d/lora_kernel_a"])


def test_enable_lora_after_the_freezer_is_named_as_the_cause():
    keras.utils.set_random_seed(11)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, name="d"), keras.layers.Dense(3, name="head")])
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/d/**")]))
    m.get_layer("d").enable_lora(2)  # new variables the Freezer never saw
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    with pytest.raises(ff.PlanError, match=r"made after its Freezer.*enable_lora"):
        m.fit(data()[0], np.zeros((16, 3), "float32"), verbose=0)
