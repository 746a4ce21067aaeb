"""Contracts of the Keras seam: each function of ``finefreeze._keras`` against the Keras behaviour it relies on.

Every Keras private name, ``keras.src`` import and attribute finefreeze sets
on Keras' objects is behind a function of ``finefreeze._keras``
(``tests/test_layering.py`` keeps them there). Each test here checks the
behaviour that function's docstring names, with real Keras objects, on the
backend in force; a Keras release that changes it fails the test named after
the function, rather than losing exactness silently.
"""

import inspect

import keras
import numpy as np
import pytest

from backend_utils import BACKEND
from finefreeze._keras import instances, layers, optimizers, quantized, variables


def _dense(units=3, inputs=4, **kwargs):
    layer = keras.layers.Dense(units, **kwargs)
    layer.build((None, inputs))
    return layer


def _built_adam(**kwargs):
    w = keras.Variable(np.ones((2, 3), "float32"), name="w")
    opt = keras.optimizers.Adam(0.1, **kwargs)
    opt.build([w])
    return opt, w


def _numpy(x):
    return np.array(keras.ops.convert_to_numpy(x), copy=True)


# -- the contract of the seam itself -------------------------------------------------------------------------


def test_every_function_of_the_seam_has_its_contract_test_here():
    names = {name for module in (instances, layers, optimizers, quantized, variables) for name in module.__all__}
    functions = {
        n
        for n in names
        if inspect.isfunction(
            getattr(instances, n, None)
            or getattr(layers, n, None)
            or getattr(optimizers, n, None)
            or getattr(quantized, n, None)
            or getattr(variables, n, None)
        )
    }
    tested = {name[len("test_") :] for name in globals() if name.startswith("test_")}
    assert functions - tested == set()


def test_every_function_of_the_seam_says_what_keras_behaviour_it_relies_on():
    for module in (instances, layers, optimizers, quantized, variables):
        for name in module.__all__:
            fn = getattr(module, name)
            if inspect.isfunction(fn):
                assert fn.__doc__ and len(fn.__doc__.strip()) > 20, f"{module.__name__}.{name}"


# -- instances ---------------------------------------------------------------------------------------------------


def test_set_instance_value():
    layer = _dense()
    x = keras.ops.ones((2, 4))
    instances.set_instance_value(layer, "call", lambda inputs, training=None: inputs[:, :3] * 0.0 + 7.0)
    assert np.array_equal(_numpy(layer(x)), np.full((2, 3), 7.0, "float32"))  # Layer.__call__ reads self.call
    assert layer.weights == [layer.kernel, layer.bias]  # nothing tracked


def test_instance_value():
    layer = _dense()
    assert instances.instance_value(layer, "_finefreeze_mark", None) is None
    instances.set_instance_value(layer, "_finefreeze_mark", 3)
    assert instances.instance_value(layer, "_finefreeze_mark") == 3
    assert instances.instance_value(object(), "x", "none") == "none"  # no __dict__: the default


def test_remove_instance_value():
    layer = _dense()
    x = keras.ops.ones((2, 4))
    own = _numpy(layer(x))
    instances.set_instance_value(layer, "call", lambda inputs, training=None: inputs)
    instances.remove_instance_value(layer, "call")
    instances.remove_instance_value(layer, "call")  # absent: nothing
    assert np.array_equal(_numpy(layer(x)), own)  # the class's call again


def test_patched():
    w = keras.Variable(np.ones((2,), "float32"), name="w")
    opt = keras.optimizers.Adam(0.1)
    made = []

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        made.append(name)
        return type(opt).add_variable_from_reference(opt, reference_variable, name, initializer)

    with instances.patched(opt, add_variable_from_reference=add_variable_from_reference):
        opt.build([w])
    assert made == ["momentum", "velocity"]  # Adam's build makes its state through the attribute
    assert "add_variable_from_reference" not in vars(opt)


def test_tag():
    v = keras.Variable(np.ones((2,), "float32"), name="v")
    assert instances.tag(v, "_finefreeze_x", "missing") == "missing"
    instances.set_tag(v, "_finefreeze_x", False)
    assert instances.tag(v, "_finefreeze_x") is False


def test_set_tag(tmp_path):
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")], name="m")
    instances.set_tag(m.layers[0], "_finefreeze_base_trainable", True)
    instances.set_tag(m.layers[0].kernel, "_finefreeze_set_flag", False)
    m.save(tmp_path / "m.keras")  # a tag is never saved: the file loads as plain Keras
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert instances.tag(loaded.layers[0], "_finefreeze_base_trainable", None) is None
    assert len(loaded.weights) == 2


def test_attributes():
    opt, _ = _built_adam()
    saved = instances.attributes(opt)
    assert saved["built"] is True and saved is not vars(opt)


def test_restore_attributes():
    opt, w = _built_adam()
    saved = instances.attributes(opt)
    optimizers.unbuild(opt)
    assert not opt.built
    instances.restore_attributes(opt, saved)
    assert opt.built and [id(v) for v in optimizers.built_on(opt)] == [id(w)]


def test_no_tracking():
    class Holder(keras.layers.Layer):
        @instances.no_tracking
        def hold(self, variables):
            self.held = list(variables)

    h = Holder()
    h.hold([keras.Variable(np.ones((2,), "float32"))])
    assert h.weights == [] and len(h.held) == 1  # assigned, not tracked


def test_in_stateless_scope():
    from keras import StatelessScope

    assert instances.in_stateless_scope() is False
    with StatelessScope():
        assert instances.in_stateless_scope() is True


@pytest.mark.backends("tensorflow", reason="tf.function's tracing")
def test_outside_the_trace():
    """A variable made in a traced first call: eager, and the call traced once."""
    import tensorflow as tf

    made = []

    @tf.function
    def f():
        if not made:
            with instances.outside_the_trace():
                assert tf.executing_eagerly()
                made.append(tf.Variable(tf.ones((3,))))
        return made[0] * 2.0

    assert _numpy(f()).tolist() == [2.0, 2.0, 2.0]
    assert _numpy(f()).tolist() == [2.0, 2.0, 2.0]
    assert f.experimental_get_tracing_count() == 1
    assert len(made) == 1 and made[0].numpy().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.backends("jax", "torch", reason="off TensorFlow only: there keras.utils.set_random_seed seeds it")
def test_seed_keras_only():
    """As ``randomness.seed`` uses it, with Python's generator seeded: the same draws again, and the seed recorded."""
    import random

    from keras.src.utils import rng_utils

    instances.seed_keras_only(7)
    random.seed(7)  # Keras' new generator takes its seed from Python's
    a = _numpy(keras.random.normal((3,)))
    instances.seed_keras_only(7)
    random.seed(7)
    assert np.array_equal(_numpy(keras.random.normal((3,))), a)  # the global generator was made anew
    assert rng_utils.get_random_seed() == 7  # what Keras' JAX distribution reads


# -- optimizers --------------------------------------------------------------------------------------------------


def test_sub_optimizers():
    assert optimizers.sub_optimizers(keras.optimizers.SGD()) == []


def test_own_variables():
    opt, _ = _built_adam()
    assert [id(v) for v in optimizers.own_variables(opt)] == [id(v) for v in opt.variables]
    assert len(optimizers.own_variables(opt)) == 4  # iterations, learning rate, momentum, velocity


def test_built_on():
    opt, w = _built_adam()
    assert [id(v) for v in optimizers.built_on(opt)] == [id(w)]


def test_forget_positions():
    w = keras.Variable(np.ones((2, 3), "float32"), name="w")
    v = keras.Variable(np.ones((3,), "float32"), name="v")
    opt = keras.optimizers.SGD(0.1)
    opt.build([w])
    optimizers.forget_positions(opt)
    keras.optimizers.Optimizer.build(opt, [v])  # the positions of the new list only
    with pytest.raises(ValueError):
        opt.apply([keras.ops.ones((2, 3))], [w])  # w is not among them any more


def test_unbuild():
    w = keras.Variable(np.ones((2, 3), "float32"), name="w")
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["w"])
    opt.build([w])
    opt._use_weight_decay(w)  # fills Keras' cache of decisions, keyed by the variable
    optimizers.untrack(opt, optimizers.own_variables(opt)[2:])
    optimizers.unbuild(opt)
    assert not opt.built and optimizers.built_on(opt) == []
    caches = {k: v for k, v in vars(opt).items() if "cache" in k or "indices" in k}
    assert caches and all(v == {} for v in caches.values()), caches  # nothing keyed by the old variables
    opt.build([w])  # builds again, as new
    assert opt.built and len(opt.variables) == 4


def test_untrack():
    opt, _ = _built_adam()
    state = optimizers.own_variables(opt)[2:]
    optimizers.untrack(opt, state)
    assert len(opt.variables) == 2 and all(id(s) not in {id(v) for v in opt.variables} for s in state)


def test_retrack():
    opt, _ = _built_adam()
    kept = list(optimizers.own_variables(opt))
    optimizers.retrack(opt, kept[:3])
    assert [id(v) for v in opt.variables] == [id(v) for v in kept[:3]]


def test_var_key():
    opt, w = _built_adam()
    v = keras.Variable(np.ones((3,), "float32"), name="w")  # the same name: another key
    assert optimizers.var_key(opt, w) == optimizers.var_key(opt, w) != optimizers.var_key(opt, v)


def test_decay_as():
    vector = keras.Variable(np.ones((3,), "float32"), name="vector")
    other = keras.Variable(np.ones((3,), "float32"), name="other")
    kernel = keras.Variable(np.ones((2, 3), "float32"), name="kernel")
    opt = keras.optimizers.AdamW(0.1, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["kernel"])
    opt.build([vector, other])
    optimizers.decay_as(opt, vector, kernel)
    opt.apply([keras.ops.zeros((3,)), keras.ops.zeros((3,))], [vector, other])
    assert np.array_equal(_numpy(vector), np.ones(3, "float32"))  # decays as the excluded kernel: not at all
    assert not np.array_equal(_numpy(other), np.ones(3, "float32"))  # a zero gradient: decay alone moved it


def test_iterations_variable():
    opt, w = _built_adam()
    opt.apply([keras.ops.ones((2, 3))], [w])
    assert int(_numpy(optimizers.iterations_variable(opt))) == 1 == int(_numpy(opt.iterations))


def test_nadam_product():
    w = keras.Variable(np.ones((2,), "float32"))
    nadam = keras.optimizers.Nadam(0.1)
    nadam.build([w])
    assert optimizers.nadam_product(nadam) is not None
    assert optimizers.nadam_product(keras.optimizers.Adam()) is None


def test_counting_from():
    """Adam's and Nadam's first step from a count of 0: a fresh optimizer's bytes, whatever the global count."""
    g = np.array([0.5, -2.0, 1.0], "float32")
    for make in (keras.optimizers.Adam, keras.optimizers.Nadam):
        fresh_w = keras.Variable(np.ones((3,), "float32"))
        fresh = make(0.1)
        fresh.build([fresh_w])
        fresh.update_step(keras.ops.convert_to_tensor(g), fresh_w, fresh.learning_rate)
        w = keras.Variable(np.ones((3,), "float32"))
        opt = make(0.1)
        opt.build([w])
        opt.iterations.assign(40)
        product = None
        if optimizers.nadam_product(opt) is not None:
            optimizers.nadam_product(opt).assign(0.25)  # its own product, after 40 steps
            product = keras.Variable(_numpy(optimizers.nadam_product(fresh)))  # a fresh element's
        with optimizers.counting_from(opt, keras.ops.subtract(opt.iterations, 40), product):
            if product is not None:
                assert optimizers.nadam_product(opt) is product
            opt.update_step(keras.ops.convert_to_tensor(g), w, opt.learning_rate)
        assert np.array_equal(_numpy(w), _numpy(fresh_w)), make.__name__
        assert int(_numpy(opt.iterations)) == 40  # put back after the block
        if product is not None:
            assert float(_numpy(optimizers.nadam_product(opt))) == 0.25


def test_replace_update_step():
    w = keras.Variable(np.ones((3,), "float32"))
    opt = keras.optimizers.Adam(0.1)
    seen = []

    def make(plain):
        def update_step(gradient, variable, learning_rate):
            seen.append(optimizers.var_key(opt, variable))
            return plain(gradient, variable, learning_rate)

        return update_step

    assert optimizers.replace_update_step(opt, make) is True
    assert optimizers.replace_update_step(opt, make) is False  # once per optimizer
    opt.apply([keras.ops.ones((3,))], [w])
    if BACKEND == "torch":  # Keras' PyTorch optimizers step all variables at once (fused_update_step)
        assert seen == [] and optimizers.fused_update_step(opt) is not None
    else:
        assert seen == [optimizers.var_key(opt, w)]


def test_fused_update_step():
    opt = keras.optimizers.Adam(0.1)
    assert (optimizers.fused_update_step(opt) is not None) == (BACKEND == "torch")


def test_replace_fused_update_step():
    w = keras.Variable(np.ones((3,), "float32"))
    opt = keras.optimizers.Adam(0.1)
    fused, seen = optimizers.fused_update_step(opt), []
    if fused is None:  # off PyTorch there is none to replace: apply steps each variable (update_step)
        assert BACKEND != "torch"
        return

    def step(grads, variables, learning_rate):
        seen.append(len(variables))
        return fused(grads, variables, learning_rate)

    optimizers.replace_fused_update_step(opt, step)
    opt.apply([keras.ops.ones((3,))], [w])
    assert seen == [1]


def test_optimizer_strategy():
    if BACKEND != "tensorflow":
        assert optimizers.optimizer_strategy(keras.optimizers.Adam()) is None
        return
    import tensorflow as tf

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        opt = keras.optimizers.Adam()
    assert optimizers.optimizer_strategy(opt) is strategy


def test_variable_strategy():
    if BACKEND != "tensorflow":
        assert optimizers.variable_strategy(keras.Variable(1.0).value) is None
        return
    import tensorflow as tf

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        v = keras.Variable(np.ones((2,), "float32"))
    assert optimizers.variable_strategy(v.value) is strategy
    assert optimizers.variable_strategy(keras.Variable(1.0).value) is None


def test_base_settings():
    settings = optimizers.base_settings()
    assert {"learning_rate", "weight_decay", "clipnorm", "use_ema", "gradient_accumulation_steps"} <= settings


# -- layers ------------------------------------------------------------------------------------------------------


def _nested():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")], name="inner")
    i = keras.Input((4,))
    return keras.Model(i, keras.layers.Dropout(0.5, name="drop")(inner(i)), name="outer"), inner


def test_all_layers():
    outer, inner = _nested()
    names = [x.name for x in layers.all_layers(outer)]
    assert names[0] == "outer" and {"inner", "a", "drop"} <= set(names)
    assert "outer" not in [x.name for x in layers.all_layers(outer, include_self=False)]


def test_sublayers():
    outer, inner = _nested()
    assert "a" in [x.name for x in layers.sublayers(inner)]
    assert layers.sublayers(keras.Variable(1.0)) == []


def test_add_sublayer():
    d = _dense()
    extra = _dense(2, 2)
    layers.add_sublayer(d, extra)
    assert any(w is extra.kernel for w in d.weights)  # weights read the sub-layers
    assert extra in layers.all_layers(d)


def test_remove_sublayer():
    d = _dense()
    extra = _dense(2, 2)
    layers.add_sublayer(d, extra)
    layers.remove_sublayer(d, extra)
    layers.remove_sublayer(d, extra)  # absent: nothing
    assert len(d.weights) == 2


def test_own_weights():
    bn = keras.layers.BatchNormalization()
    bn.build((None, 3))
    trainable, statistics = layers.own_weights(bn)
    assert [w.name for w in trainable] == ["gamma", "beta"]
    assert [w.name for w in statistics] == ["moving_mean", "moving_variance"]


def test_inbound_tensors():
    i = keras.Input((4,), dtype="int32")
    e = keras.layers.Embedding(10, 2, name="e")
    keras.Model(i, e(i))
    assert any(t is i for t in layers.inbound_tensors(e))


def test_seed_generators():
    drop = keras.layers.Dropout(0.5)
    assert len(layers.seed_generators(drop)) == 1
    assert layers.seed_generators(_dense()) == []


def test_lora_enabled_layers():
    assert layers.lora_enabled_layers(_dense()) == []


def test_rematerialized():
    assert not layers.rematerialized(_dense())
    with keras.RematScope(mode="full"):
        d = keras.layers.Dense(2)
    assert layers.rematerialized(d)


def test_remat_each_call():
    """Keras calls a rematerialized layer through ``rematerialized_call(call, *args)``: a call set on the instance too."""
    with keras.RematScope(mode="full"):
        d = keras.layers.Dense(2)
    d.build((None, 3))
    x = np.arange(6, dtype="float32").reshape(2, 3)
    want = keras.ops.convert_to_numpy(d(x))
    calls = []

    def call(inputs):  # one function for as long as it is set, as finefreeze's calls are
        calls.append(1)
        return type(d).call(d, inputs)

    instances.set_instance_value(d, "call", call)
    instances.set_instance_value(d, "rematerialized_call", layers.remat_each_call(d))
    for n in (1, 2):
        assert np.array_equal(keras.ops.convert_to_numpy(d(x)), want) and len(calls) == n


def test_kernel_variable():
    d = _dense()
    d.enable_lora(2)
    assert layers.kernel_variable(d) is not None and not layers.kernel_variable(d).trainable  # the base kernel
    conv = keras.layers.Conv2D(2, 3)
    conv.build((None, 5, 5, 1))
    assert layers.kernel_variable(conv) is conv.kernel


def test_embeddings_variable():
    e = keras.layers.Embedding(10, 2)
    e.build((None,))
    assert layers.embeddings_variable(e) is e.embeddings
    assert layers.embeddings_variable(_dense()) is None


def test_is_convolution():
    conv = keras.layers.Conv1D(2, 3)
    assert layers.is_convolution(conv, plain=True)

    class Mine(keras.layers.Conv1D):
        def call(self, inputs):
            return super().call(inputs) * 2.0

    assert layers.is_convolution(Mine(2, 3)) and not layers.is_convolution(Mine(2, 3), plain=True)
    assert not layers.is_convolution(keras.layers.Conv2DTranspose(2, 3))
    assert not layers.is_convolution(_dense())


def test_causal_padding():
    conv = keras.layers.Conv1D(2, 3, padding="causal", dilation_rate=2)
    conv.build((None, 8, 1))
    x = np.random.default_rng(0).normal(size=(2, 8, 1)).astype("float32")
    padded = keras.ops.pad(keras.ops.convert_to_tensor(x), layers.causal_padding(conv))
    valid = keras.ops.conv(padded, conv.kernel, strides=1, padding="valid", dilation_rate=2) + conv.bias
    assert np.array_equal(_numpy(valid), _numpy(conv(x)))  # Conv1D.call pads, then convolves "valid"


def test_set_keras_mask():
    out = keras.ops.ones((2, 3))
    mask = keras.ops.convert_to_tensor(np.array([[True, True, False], [True, False, False]]))
    layers.set_keras_mask(out, mask)
    assert np.array_equal(_numpy(out._keras_mask), _numpy(mask))


@pytest.mark.backends("tensorflow", reason="tf.Module: TensorFlow's own variables")
def test_module_variables():
    import tensorflow as tf

    class M(tf.Module):
        def __init__(self):
            self.w = tf.Variable([1.0], name="w")
            self.inner = tf.Module()
            self.inner.b = tf.Variable([2.0], name="b")

    pairs = layers.module_variables(M(), lambda x: isinstance(x, tf.Variable))
    assert sorted("/".join(map(str, p)) for p, _ in pairs) == ["inner/b", "w"]


# -- variables ---------------------------------------------------------------------------------------------------


def test_distribution_layout():
    v = keras.Variable(np.ones((2,), "float32"))
    assert variables.distribution_layout(v) is None
    if BACKEND == "jax":
        from keras.distribution import DeviceMesh, LayoutMap, ModelParallel

        mesh = DeviceMesh((1,), ["model"], keras.distribution.list_devices()[:1])
        layout_map = LayoutMap(mesh)
        layout_map["d/kernel"] = (None, "model")
        with ModelParallel(layout_map=layout_map).scope():
            d = keras.layers.Dense(2, name="d")
            d.build((None, 3))
        assert variables.distribution_layout(d.kernel) is not None


# -- the layers' own call, sliced: equal to Keras' -------------------------------------------------------------

#: (layer, input shape, trained part of the kernel) for every covered class and config option
SLICED = {
    "Dense": (lambda: keras.layers.Dense(6, name="k"), (5, 8), np.s_[:, 1:3]),
    "Dense no bias, gelu": (
        lambda: keras.layers.Dense(6, use_bias=False, activation="gelu", name="k"),
        (5, 8),
        np.s_[2:5],
    ),
    "Dense scattered (sampled)": (lambda: keras.layers.Dense(64, name="k"), (5, 64), np.diag_indices(64)),
    "EinsumDense heads, bias": (
        lambda: keras.layers.EinsumDense("abc,cde->abde", (4, 3, 2), bias_axes="de", activation="tanh", name="k"),
        (5, 4, 6),
        np.s_[:, 1],
    ),
    "Conv1D valid": (lambda: keras.layers.Conv1D(4, 3, name="k"), (5, 9, 3), np.s_[..., 2:]),
    "Conv1D causal, dilated": (
        lambda: keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, name="k"),
        (5, 9, 3),
        np.s_[..., 1:3],
    ),
    "Conv2D strided, no bias": (
        lambda: keras.layers.Conv2D(4, 3, strides=2, use_bias=False, activation="relu", name="k"),
        (5, 7, 7, 2),
        np.s_[:, :, 1:],
    ),
    "Conv3D same": (lambda: keras.layers.Conv3D(3, 2, padding="same", name="k"), (2, 4, 4, 4, 2), np.s_[..., :1]),
    "Embedding rows": (lambda: keras.layers.Embedding(20, 4, name="k"), (5, 6), np.s_[16:]),
}


def _input_gradient(model, x):
    """The gradient of ``sum(model(x) ** 2)`` with respect to ``x``, on the backend in force."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        t = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(t)
            loss = tf.reduce_sum(model(t) ** 2)
        return _numpy(tape.gradient(loss, t))
    if BACKEND == "jax":
        import jax

        return _numpy(jax.grad(lambda t: keras.ops.sum(model(t) ** 2))(keras.ops.convert_to_tensor(x)))
    t = keras.ops.convert_to_tensor(x)
    t.requires_grad_(True)
    keras.ops.sum(model(t) ** 2).backward()
    return _numpy(t.grad)


@pytest.mark.parametrize("case", list(SLICED))
def test_a_sliced_layers_output_and_input_gradient_are_keras_own_bit_for_bit(case):
    import finefreeze as ff

    make, shape, part = SLICED[case]
    rng = np.random.default_rng(0)
    ids = case.startswith("Embedding")
    x = rng.integers(0, 20, size=shape).astype("int32") if ids else rng.normal(size=shape).astype("float32")
    mine, plain = make(), make()
    i = keras.Input(shape[1:], dtype="int32" if ids else "float32")
    model, reference = keras.Model(i, mine(i)), keras.Model(i, plain(i))
    reference.set_weights(model.get_weights())
    kernel = layers.embeddings_variable(mine) if ids else layers.kernel_variable(mine)
    mask = np.ones(kernel.shape, bool)
    mask[part] = False
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/k/**"), ff.train(kernel.path, mask=~mask)]), gradients="sliced")
    assert instances.instance_value(mine, "call", None) is not None, "the layer's own call is in place"
    if "sampled" in case:
        assert instances.instance_value(mine, "_finefreeze_sliced").slice.kind == "sampled"
    t = keras.ops.convert_to_tensor(x)
    assert np.array_equal(_numpy(model(t)), _numpy(reference(t)))
    if not ids:  # the input gradient: Keras' own, bit for bit
        assert np.array_equal(_input_gradient(model, x), _input_gradient(reference, x))
    assert kernel.path in frz._gradients_record()["sliced"]


def test_a_lora_layer_keeps_keras_own_call_and_a_quantized_kernel_gets_a_delta_beside_keras_quantized_call():
    import finefreeze as ff

    i = keras.Input((8,))
    d = keras.layers.Dense(6, name="k")
    model = keras.Model(i, d(i))
    d.enable_lora(2)
    trained = np.zeros((8, 6), bool)
    trained[:, :2] = True
    frz = ff.Freezer(model, ff.Plan([ff.train("k/kernel", mask=trained)]), gradients="sliced")
    assert instances.instance_value(d, "call", None) is None  # never replaced: the dense path, Keras' own
    assert frz._gradients_record()["sliced"] == []
    q = keras.layers.Dense(6, name="k")
    qmodel = keras.Model(i, q(i))
    q.quantize("int8")
    frz = ff.Freezer(qmodel, ff.Plan([ff.train("k/kernel", mask=trained)]), gradients="dense")
    assert instances.instance_value(q, "call", None) is None  # Keras runs quantized_call: that one is set
    assert instances.instance_value(q, "quantized_call", None) is not None  # whatever the gradients mode
    assert frz._gradients_record()["sliced"] == ["functional_1/k/kernel"] or len(frz._gradients_record()["sliced"]) == 1


# -- quantized ---------------------------------------------------------------------------------------------------


def test_float8_statistics():
    for layer in (keras.layers.Dense(4), keras.layers.EinsumDense("ab,bc->ac", 4)):
        layer.build((None, 3))
        layer.quantize("float8")
        overwritten = {v.path.rsplit("/", 1)[-1] for v in layer.weights if v.overwrite_with_gradient}
        assert overwritten == quantized.FLOAT8_STATISTICS


def _quantized_dense(mode, activation="tanh"):
    rng = np.random.default_rng(0)
    d = keras.layers.Dense(6, activation=activation)
    d.build((None, 5))
    d.kernel.assign(rng.normal(size=(5, 6)).astype("float32"))
    d.bias.assign(rng.normal(size=(6,)).astype("float32"))
    d.quantize(mode)
    return d


def test_is_quantized():
    assert quantized.is_quantized(_dense()) is None
    assert quantized.is_quantized(_quantized_dense("int8")) == "int8"
    conv = keras.layers.Conv2D(2, 3)
    conv.build((None, 5, 5, 1))
    assert quantized.is_quantized(conv) is None  # only Dense, EinsumDense and Embedding
    table = keras.layers.Embedding(10, 4)
    table.build((None,))
    table.quantize("int4")
    assert quantized.is_quantized(table) == "int4"


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_logical_shape(mode):
    d = _quantized_dense(mode)
    assert quantized.logical_shape(d) == (5, 6) == tuple(d.kernel.shape)  # Keras' kernel property unpacks int4
    e = keras.layers.EinsumDense("bd,dnh->bnh", (3, 4))
    e.build((None, 5))
    e.quantize(mode)
    assert quantized.logical_shape(e) == (5, 3, 4)
    table = keras.layers.Embedding(10, 6)
    table.build((None,))
    table.quantize(mode)
    assert quantized.logical_shape(table) == (10, 6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_reverse_table(mode):  # an untied output table: its integers, logical shape and scales
    table = keras.layers.ReversibleEmbedding(10, 6, tie_weights=False)
    table.build((None,))
    assert quantized.reverse_table(table) is None  # a float table's is Keras' own variable, trained as it is
    table.quantize(mode)
    reverse = quantized.reverse_table(table)
    assert reverse is table.reverse_embeddings and str(reverse.dtype) == "int8" and not reverse.trainable
    assert quantized.logical_shape(table, reverse) == (6, 10) and quantized.logical_shape(table) == (10, 6)
    got = quantized.quantized_values(table, reverse)
    assert got[0] is reverse and {v.path.rsplit("/", 1)[-1] for v in got} >= {"reverse_embeddings_scale"}
    assert all(not v.trainable for v in got) and not any(v is table._embeddings for v in got)
    tied = keras.layers.ReversibleEmbedding(10, 6)
    tied.build((None,))
    tied.quantize(mode)
    assert quantized.reverse_table(tied) is None


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_values(mode):
    d = _quantized_dense(mode)
    got = quantized.quantized_values(d)
    assert got[0] is d._kernel and str(d._kernel.dtype) == "int8"
    assert {v.path.rsplit("/", 1)[-1] for v in got} >= {"kernel", "kernel_scale"}
    assert all(not v.trainable for v in got)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_product(mode):
    d = _quantized_dense(mode)
    x = keras.ops.convert_to_tensor(np.random.default_rng(1).normal(size=(3, 5)).astype("float32"))
    bare = quantized.quantized_product(d, x)
    # Keras' own quantized call is the product, then the bias, then the activation: bit for bit
    assert np.array_equal(_numpy(keras.ops.tanh(keras.ops.add(bare, d.bias))), _numpy(d(x)))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_lookup(mode):
    table = keras.layers.ReversibleEmbedding(10, 6)
    table.build((None,))
    table.embeddings.assign(np.random.default_rng(2).normal(size=(10, 6)).astype("float32"))
    table.quantize(mode)
    ids = keras.ops.convert_to_tensor(np.array([[1, 9, 3]], "int32"))
    assert np.array_equal(_numpy(quantized.quantized_lookup(table, ids)), _numpy(table(ids)))  # Keras' own lookup
    h = keras.ops.convert_to_tensor(np.random.default_rng(3).normal(size=(2, 6)).astype("float32"))
    assert np.array_equal(_numpy(quantized.quantized_product(table, h, reverse=True)), _numpy(table(h, reverse=True)))
