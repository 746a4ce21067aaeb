"""A trained slice of a kernel gets its own weight gradient: the same training, the frozen part bit for bit.

``gradients="sliced"`` gives a ``Dense``, ``EinsumDense`` or ``Conv`` kernel
whose trained elements form a block (rows, columns, channels, heads) the
weight gradient of that block only. The references: plain Keras on the same
problem (the kernel split into a trained layer and a frozen one) and the
dense path (``gradients="dense"``, the whole weight gradient). Trained values
may differ from them by float rounding only, as a smaller product may be
summed in another order: :data:`BOUND`, relative to the variable's largest
value, measured at under 2e-6 on every backend after a few dozen Adam steps.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, FIT_MODES, as_kernel_gradients, gradients, strategy_of, weights_of
from finefreeze._resolve.standins import kernel_of
from finefreeze._slices.choose import MARK, kernel_slice

#: the largest difference of a trained value from the references, relative to the variable's largest value
BOUND = 2e-5

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 12)).astype("float32")
Y = RNG.normal(size=(48, 3)).astype("float32")


def model(seed=3):
    keras.utils.set_random_seed(seed)
    i = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", name="d")(i)
    h = keras.layers.Reshape((4, 4))(h)
    h = keras.layers.EinsumDense("abc,cde->abde", (4, 3, 2), name="q")(h)  # an attention projection: 3 heads
    h = keras.layers.Reshape((4, 6))(h)
    h = keras.layers.Conv1D(6, 2, padding="causal", name="c1")(h)
    h = keras.layers.Reshape((4, 3, 2))(h)
    h = keras.layers.Conv2D(4, 3, padding="same", name="c2")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(i, keras.layers.Dense(3, name="head")(h), name="m")


#: per slice kind, what trains of each kernel; the rest of every kernel is frozen
SLICES = {
    "columns, heads, output channels": [
        "**/d/kernel[:, 3:7]",
        "**/q/kernel[:, 1]",  # one head
        "**/c1/kernel[..., 1:3]",
        "**/c2/kernel[..., 2:4]",
        "**/head/kernel[:, :1]",
    ],
    "rows, input channels": [
        "**/d/kernel[[0, 5, 9]]",
        "**/q/kernel[2:]",
        "**/c1/kernel[:, 4:]",
        "**/c2/kernel[:, :, 1:]",
        "**/head/kernel[10:30]",
    ],
}


def plan(kind):
    return ff.Plan([ff.freeze("**/kernel"), *(ff.train(s) for s in SLICES[kind])])


def numpy(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def close(a, ref, what):
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(a - ref).max()) <= BOUND * scale, (what, float(np.abs(a - ref).max()) / scale)


def trained(m, p, x, y, gradients="sliced", epochs=2, **compile_kw):
    """``(model, freezer, values before)``: ``m`` fitted under ``p`` with Adam, its frozen elements the same bytes."""
    frz = ff.Freezer(m, p, gradients=gradients)
    before = {v.path: numpy(v) for v in weights_of(m)}
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse", **compile_kw)
    m.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    frz.verify()
    for v in weights_of(m):  # frozen elements: the same bytes
        frozen = frz.frozen_mask(v.path)
        assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
    return m, frz, before


def fit(p, gradients="sliced", epochs=2, seed=3, **compile_kw):
    return trained(model(seed), p, X, Y, gradients, epochs, **compile_kw)


#: every way fit runs for one slice kind, the default one for the other
CASES = [("columns, heads, output channels", m) for m in range(len(FIT_MODES))] + [("rows, input channels", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("kind, mode", CASES, ids=[f"{k.split(',')[0]}-{FIT_MODES[m] or 'default'}" for k, m in CASES])
def test_sliced_kernels_train_as_the_dense_path_does(kind, mode):
    m, frz, before = fit(plan(kind), **FIT_MODES[mode])
    sliced = [layer.name for layer in m.layers if MARK in layer.__dict__]
    assert sliced == ["d", "q", "c1", "c2", "head"]
    assert {strategy_of(frz, f"{n}/kernel") for n in sliced} == {"compact"}  # state for the slice only
    ref, _, _ = fit(plan(kind), gradients="dense", **FIT_MODES[mode])
    assert not any(MARK in layer.__dict__ for layer in ref.layers)
    for v, r in zip(weights_of(m), weights_of(ref)):
        assert not np.array_equal(numpy(v), before[v.path]), f"{v.path} did not train"
        close(numpy(v), numpy(r), v.path)


def split_model():
    """Plain Keras on the same problem: ``d``'s kernel as a trained layer (3 columns) beside a frozen one (5)."""
    keras.utils.set_random_seed(3)
    i = keras.Input((12,))
    t = keras.layers.Dense(3, activation="relu", name="t")(i)
    f = keras.layers.Dense(5, activation="relu", name="f")(i)
    h = keras.layers.Concatenate()([t, f])
    return keras.Model(i, keras.layers.Dense(3, name="head")(h), name="split")


def test_a_sliced_dense_kernel_trains_as_plain_keras_trains_the_slice_as_a_layer_of_its_own():
    keras.utils.set_random_seed(3)
    i = keras.Input((12,))
    m = keras.Model(i, keras.layers.Dense(3, name="head")(keras.layers.Dense(8, activation="relu", name="d")(i)))
    ref = split_model()
    k, b = (numpy(v) for v in weights_of(m.get_layer("d")))
    ref.get_layer("t").set_weights([k[:, :3], b[:3]])
    ref.get_layer("f").set_weights([k[:, 3:], b[3:]])
    ref.get_layer("head").set_weights(m.get_layer("head").get_weights())
    ref.get_layer("f").kernel.trainable = False  # its bias trains, as d's does
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/d/kernel"), ff.train("**/d/kernel[:, :3]")]), gradients="sliced")
    assert MARK in m.get_layer("d").__dict__
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    ref.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for _ in range(2):
        m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        ref.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    k2, b2 = (numpy(v) for v in weights_of(m.get_layer("d")))
    assert np.array_equal(k2[:, 3:], k[:, 3:])
    close(k2[:, :3], numpy(ref.get_layer("t").kernel), "trained columns")
    close(b2, np.concatenate([numpy(ref.get_layer("t").bias), numpy(ref.get_layer("f").bias)]), "bias")
    close(numpy(m.get_layer("head").kernel), numpy(ref.get_layer("head").kernel), "head")


def test_the_output_and_the_input_gradient_are_the_layers_own_and_the_kernel_gradient_the_slices():
    m = model()
    frz = ff.Freezer(m, plan("columns, heads, output channels"), gradients="sliced")
    x = keras.ops.convert_to_tensor(X[:8])
    plain = model()
    assert np.array_equal(numpy(m(x)), numpy(plain(x)))  # the forward: bit for bit
    variables = list(m.trainable_weights)  # every kernel partly trained, and each one's stand-in
    standins = [v for v in variables if kernel_of(v) is not None]
    assert [kernel_of(v).path for v in standins] == [f"{n}/kernel" for n in ("d", "q", "c1", "c2", "head")]
    grads = gradients(lambda: keras.ops.sum(m(x) ** 2), variables)
    for v, g in zip(variables, grads):
        if kernel_of(v) is None and v.path.endswith("kernel"):  # the kernel itself: no gradient at all
            assert g is None or not np.any(numpy(g)), v.path
        if kernel_of(v) is not None:  # the stand-in's: one value per trained element, nothing else computed
            assert tuple(g.shape) == (int(np.count_nonzero(~frz.frozen_mask(kernel_of(v).path))),), v.path
    got = as_kernel_gradients(frz, variables, grads)
    ref = gradients(lambda: keras.ops.sum(plain(x) ** 2), list(plain.trainable_weights))
    for v, r in zip(plain.trainable_weights, ref):
        g, r = got[v.path.replace(plain.name, m.name, 1)], numpy(r)
        if v.path.endswith("kernel"):
            trained = ~frz.frozen_mask(v.path.replace(plain.name, m.name, 1))
            assert not np.any(g[~trained]), v.path  # frozen elements: exactly 0, never computed
            close(g[trained], r[trained], v.path)
        else:
            assert np.array_equal(g, r), v.path  # biases: their gradient is the plain one, bit for bit


def test_masks_that_are_slices_are_recognised_and_scattered_elements_are_not():
    d = keras.layers.Dense(10)
    d.build((None, 6))
    frozen = np.ones((6, 10), bool)
    frozen[:, [1, 4]] = False  # whole columns, as a mask= or select gives them
    s = kernel_slice(d, d.kernel, frozen)
    assert s.index[0] is None and s.index[1].tolist() == [1, 4]
    frozen[2, 1] = True  # a frozen element inside the block: still the block of columns 1 and 4
    assert kernel_slice(d, d.kernel, frozen).index[1].tolist() == [1, 4]
    scattered = np.ones((6, 10), bool)
    scattered[np.arange(6), np.arange(6)] = False  # a diagonal: every row and six columns, 60 % of the kernel
    assert kernel_slice(d, d.kernel, scattered) is None
    rows_and_cols = np.ones((6, 10), bool)
    rows_and_cols[1:3, 7:9] = False
    s = kernel_slice(d, d.kernel, rows_and_cols)
    assert s.index[0].tolist() == [1, 2] and s.index[1].tolist() == [7, 8] and s.size == 4


def test_layers_with_their_own_call_lora_or_groups_keep_the_dense_path():
    class MyDense(keras.layers.Dense):
        def call(self, inputs, training=None):
            return super().call(inputs) * 2.0

    frozen = np.ones((4, 6), bool)
    frozen[:, 0] = False
    mine = MyDense(6)
    mine.build((None, 4))
    assert kernel_slice(mine, mine.kernel, frozen) is None
    lora = keras.layers.Dense(6)
    lora.build((None, 4))
    lora.enable_lora(2)
    assert kernel_slice(lora, lora._kernel, frozen) is None
    conv = keras.layers.Conv2D(4, 3, groups=2)
    conv.build((None, 5, 5, 4))
    f = np.ones(conv.kernel.shape, bool)
    f[..., 0] = False
    assert kernel_slice(conv, conv.kernel, f) is None


def test_plan_changes_between_slices_and_element_masks_retrace_and_keep_training_exact():
    m = model()
    frz = ff.Freezer(m, plan("columns, heads, output channels"), gradients="sliced")
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    d = m.get_layer("d")
    first = d.__dict__[MARK].slice.key
    mask = np.zeros((12, 16), bool)
    mask[np.arange(12), np.arange(12)] = True  # scattered elements: no slice
    steps = [
        ff.Plan([ff.freeze("**/kernel"), ff.train("**/d/kernel", mask=mask)]),
        ff.Plan([ff.freeze("**/kernel"), ff.train("**/d/kernel[:, 8:]")]),  # another slice
    ]
    for p in steps:
        before = {v.path: numpy(v) for v in weights_of(m)}
        frz.update(p)
        assert frz.history[-1]["retraced"]
        m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        for v in weights_of(m):
            frozen = frz.frozen_mask(v.path)
            assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
    assert MARK in d.__dict__ and d.__dict__[MARK].slice.key != first
    assert d.__dict__[MARK].slice.index[1].tolist() == list(range(8, 16))
    frz.update(ff.Plan([]))  # everything trains: no slice left
    assert not any(MARK in layer.__dict__ or "call" in layer.__dict__ for layer in m.layers)


def test_a_model_saved_while_slices_train_loads_as_plain_keras(tmp_path):
    m, frz, _ = fit(plan("rows, input channels"), epochs=1)
    config = {layer.name: layer.get_config() for layer in m.layers}
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert {layer.name: layer.get_config() for layer in loaded.layers} == config
    assert [type(a) for a in loaded.layers] == [type(b) for b in m.layers]
    assert not any("call" in layer.__dict__ for layer in loaded.layers)
    for a, b in zip(weights_of(loaded), weights_of(m)):
        assert np.array_equal(numpy(a), numpy(b)), a.path
    again = ff.Freezer.of(loaded)  # rebuilt from the file: the gradients it was saved with
    assert again._gradients == "sliced"
    assert sorted(layer.name for layer in loaded.layers if MARK in layer.__dict__) == sorted(
        layer.name for layer in m.layers if MARK in layer.__dict__
    )
    before = {v.path: numpy(v) for v in weights_of(loaded)}
    loaded.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # the run that was not interrupted
    again.verify()
    for v, w in zip(weights_of(loaded), weights_of(m)):
        frozen = again.frozen_mask(v.path)
        assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
        assert np.array_equal(numpy(v), numpy(w)), v.path  # the resumed run is the same run, bit for bit


def test_a_file_of_an_earlier_release_resumes_on_the_dense_gradients(tmp_path):
    """Its optimizer config has no "gradients": it trained on the dense path, and resumes on it."""
    import json
    import zipfile

    m, frz, _ = fit(plan("rows, input channels"), epochs=1)
    m.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as z:
        files = {n: z.read(n) for n in z.namelist()}
    config = json.loads(files["config.json"])
    del config["compile_config"]["optimizer"]["config"]["gradients"]
    files["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(tmp_path / "old.keras", "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    loaded = keras.models.load_model(tmp_path / "old.keras")
    again = ff.Freezer.of(loaded)
    assert again._gradients == "dense"
    assert not any(MARK in layer.__dict__ for layer in loaded.layers)
    loaded.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    again.verify()


def test_gradients_dense_switches_the_slices_off_and_a_wrong_value_is_refused():
    m = model()
    ff.Freezer(m, plan("columns, heads, output channels"), gradients="dense")
    assert not any(MARK in layer.__dict__ for layer in m.layers)
    with pytest.raises(ff.PlanError, match="gradients='sparse'.*'auto'.*'sliced'.*'dense'"):
        ff.Freezer(m, plan("columns, heads, output channels"), gradients="sparse")


def test_once_the_freezer_is_gone_the_layers_compute_dense_gradients():
    import gc

    m = model()
    ff.Freezer(m, plan("columns, heads, output channels"), gradients="sliced")
    gc.collect()
    x = keras.ops.convert_to_tensor(X[:8])
    k = m.get_layer("d").kernel
    g = numpy(gradients(lambda: keras.ops.sum(m(x) ** 2), [k])[0])
    assert np.count_nonzero(g[:, :3]) > 0  # outside the slice it trained: the plain gradient again


@pytest.mark.slow
def test_mixed_precision_slices_train_as_the_dense_path_does():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        m, _, _ = fit(plan("columns, heads, output channels"), epochs=1)
        ref, _, _ = fit(plan("columns, heads, output channels"), gradients="dense", epochs=1)
    finally:
        keras.config.set_dtype_policy("float32")
    for v, r in zip(weights_of(m), weights_of(ref)):
        scale = max(float(np.abs(numpy(r)).max()), 1e-30)
        assert float(np.abs(numpy(v) - numpy(r)).max()) <= 2e-3 * scale, v.path  # float16 products


def _product_sizes(layer, x):
    """The element counts of every product (matmul, convolution) the gradient of ``sum(layer(x)**2)`` computes."""
    variables = [layer.kernel]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda: gradients(lambda: keras.ops.sum(layer(x) ** 2), variables))
        graph = step.get_concrete_function().graph
        kinds = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput")
        ops = [o for o in graph.get_operations() if o.type in kinds]
        return [int(np.prod(o.outputs[0].shape)) for o in ops]
    if BACKEND == "jax":
        import jax

        def loss(k):
            with keras.StatelessScope(state_mapping=[(layer.kernel, k)]):
                return keras.ops.sum(layer(x) ** 2)

        text = str(jax.make_jaxpr(jax.grad(loss))(layer.kernel.value))
        sizes = []
        for line in text.splitlines():
            if "dot_general[" in line or "conv_general_dilated[" in line:
                shape = line.split("=")[0].split(":")[-1].strip()  # f32[7,3]
                sizes.append(int(np.prod([int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d])))
        return sizes
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__
            if name.startswith(("mm", "addmm", "bmm", "convolution")):
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor):
                        sizes.append(int(t.numel()))
            return out

    with Products():
        gradients(lambda: keras.ops.sum(layer(x) ** 2), variables)
    return sizes


@pytest.mark.parametrize("kind", ["Dense", "Conv2D"])
def test_the_full_weight_gradient_is_never_computed(kind):
    """No product of the kernel's size: a check that fails when the dense path is taken (``gradients="dense"``)."""
    if kind == "Dense":
        layer, x, trained = keras.layers.Dense(11, use_bias=False), X[:5, :7], "[:, 2:5]"
    else:
        layer, x, trained = keras.layers.Conv2D(5, 3, use_bias=False), RNG.normal(size=(2, 6, 6, 7)), "[..., 1:3]"
    x = keras.ops.convert_to_tensor(x.astype("float32"))
    layer(x)
    full = int(np.prod(layer.kernel.shape))
    for gradients_, expected in (("dense", True), ("sliced", False)):
        frz = ff.Freezer([layer.kernel], ff.Plan([ff.freeze("**"), ff.train(layer.kernel.path + trained)]))
        assert MARK not in layer.__dict__  # a list of variables: the Freezer does not know their layer
        frz = ff.Freezer(layer, ff.Plan([ff.freeze("**"), ff.train("**/kernel" + trained)]), gradients=gradients_)
        assert (MARK in layer.__dict__) is not expected
        assert (full in _product_sizes(layer, x)) is expected, gradients_
        del frz


@pytest.mark.parametrize("structure, axis", [("columns", -1), ("rows", 0)])
def test_select_with_a_structure_chooses_whole_slices_that_train_at_their_own_cost(structure, axis):
    m = model()
    p = ff.select(
        m, (X, Y), budget=0.15, score="gradient", loss="mse", batch_size=16, structure=structure, options={"verbose": 0}
    )
    frz = ff.Freezer(m, p, gradients="sliced")
    n_trained = 0
    for name in ("d", "q", "c1", "c2", "head"):
        v = m.get_layer(name).kernel
        trained = ~frz.frozen_mask(v.path)
        n_trained += int(trained.sum())
        lines = np.moveaxis(trained, axis, 0).reshape(trained.shape[axis], -1)
        assert np.all(lines.all(axis=1) | ~lines.any(axis=1)), name  # whole slices, nothing in between
    assert (
        frz.report()["totals"]["trainable_elements"]
        <= int(0.15 * sum(int(np.prod(v.shape)) for v in weights_of(m))) + 1
    )
    assert n_trained > 0 and any(MARK in layer.__dict__ for layer in m.layers)


def test_structured_choice_takes_the_best_mean_scores_that_fit_and_finds_the_heads():
    from finefreeze._select.structure import choose_slices, slice_axis

    scores = [np.array([[1.0, 9.0, 4.0], [1.0, 7.0, 4.0]]), np.array([5.0, 0.5])]
    allowed = [np.ones((2, 3), bool), np.ones(2, bool)]
    got = choose_slices(scores, allowed, [1, 0], 3)  # column 1 (mean 8), then the bias 5.0; column 2 would not fit
    assert got[0].astype(int).tolist() == [[0, 1, 0], [0, 1, 0]] and got[1].tolist() == [True, False]
    q = keras.layers.EinsumDense("abc,cde->abde", (4, 3, 2))
    q.build((None, 4, 8))
    o = keras.layers.EinsumDense("abcd,cde->abe", (4, 8))
    o.build((None, 4, 3, 2))
    assert slice_axis("heads", tuple(q.kernel.shape), q) == 1 and slice_axis("heads", tuple(o.kernel.shape), o) == 0
    with pytest.raises(ff.PlanError, match="structure='blocks'"):
        ff.select(model(), budget=3, score="magnitude", structure="blocks")


def test_a_layer_two_live_freezers_plan_keeps_the_dense_gradient():
    """Two plans trained by turns (a GAN's): each optimizer must get the gradient of its own trained elements."""
    m = model()
    a = ff.Freezer(m, ff.Plan([ff.freeze("**/kernel"), ff.train("**/d/kernel[:, :4]")]), gradients="sliced")
    assert MARK in m.get_layer("d").__dict__
    b = ff.Freezer(m, ff.Plan([ff.freeze("**/kernel"), ff.train("**/d/kernel[:, 8:10]")]), gradients="sliced")
    assert not any(MARK in layer.__dict__ for layer in m.layers)
    m.compile(optimizer=a.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    k = numpy(m.get_layer("d").kernel)
    m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    moved = np.flatnonzero((numpy(m.get_layer("d").kernel) != k).any(axis=0)).tolist()
    assert moved == [0, 1, 2, 3]  # a's columns, not b's
    a.verify()
    del b
    a.activate()  # b is gone: a slices its kernels again
    assert MARK in m.get_layer("d").__dict__


def test_a_sliced_step_names_no_keras_operation_so_torch_compile_compiles_it_once():
    """``torch.compile`` guards on Keras' global counter of operation names (``keras.ops.pad`` made a
    named ``Pad`` at every call): a step that bumped it compiled again at every step."""
    from keras.src.backend.common import global_state

    def names():
        return dict(global_state.get_global_attribute("object_name_uids", default=None) or {})

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 256)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    ids = rng.integers(0, 40, (16, 7)).astype("int32")
    scattered = np.eye(256, dtype=bool)[rng.permutation(256)]
    cases = {
        "columns": ("d/kernel[:, 10:20]", None, "sliced"),
        "rows, an index list": ("d/kernel[[1, 5, 9]]", None, "sliced"),
        "scattered elements": ("d/kernel", scattered, "sampled"),
        "new rows of a table": ("tok/embeddings[35:]", None, "sliced"),
    }
    for case, (rows, mask, kind) in cases.items():
        keras.utils.set_random_seed(2)
        if case.startswith("new rows"):
            i = keras.Input((7,), dtype="int32")
            h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(40, 6, name="tok")(i))
            data = (ids, y)
        else:
            i = keras.Input((256,))
            h = keras.layers.Dense(256, name="d")(i)
            data = (x, y)
        m = keras.Model(i, keras.layers.Dense(2, name="head")(h))
        variable = rows.split("[")[0]
        frz = ff.Freezer(m, ff.Plan([ff.freeze(variable), ff.train(rows, mask=mask)]), gradients="sliced")
        assert {v["path"]: v["gradient"] for v in frz.report()["variables"]}[variable] == kind, case
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
        m.train_on_batch(*data)  # builds
        before = names()
        m.train_on_batch(*data)
        assert names() == before, (case, {k: v for k, v in names().items() if before.get(k) != v})


@pytest.mark.slow
def test_the_optimizer_keeps_its_freezer_and_the_stand_ins_go_with_both():
    """``compile(optimizer=ff.Freezer(...).wrap(...))``, no reference kept, trains on the stand-ins.

    The wrapped optimizer holds its Freezer: the shortest spelling keeps the
    trained elements' own gradient (no dense kernel gradient). The stand-ins
    go once the model compiles with another optimizer and nothing else holds
    the Freezer.
    """
    import gc

    x = RNG.normal(size=(32, 64)).astype("float32")
    y = RNG.normal(size=(32, 2)).astype("float32")
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, name="d"), keras.layers.Dense(2, name="h")])
    plan = ff.Plan([ff.freeze("**"), ff.train("**/d/kernel[:, :8]")])
    m.compile(optimizer=ff.Freezer(m, plan, gradients="sliced").wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    gc.collect()
    before = keras.ops.convert_to_numpy(m.get_layer("d").kernel).copy()
    m.fit(x, y, epochs=1, verbose=0)
    gc.collect()
    after = keras.ops.convert_to_numpy(m.get_layer("d").kernel)
    assert np.array_equal(after[:, 8:], before[:, 8:]) and (after[:, :8] != before[:, :8]).any()
    frz = ff.Freezer.of(m)
    assert frz is not None and frz._gradients == "sliced"
    kinds = {v["path"]: v.get("gradient") for v in frz.report()["variables"]}
    assert kinds[m.get_layer("d").kernel.path] == "sliced", kinds
    assert len(m.weights) == 5  # the stand-in of d/kernel's 8 columns
    del frz
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    gc.collect()
    assert len(m.weights) == 4


def _compiled_cases():
    """(name, model, the Freezer's plan, input) for each kind of sliced call: a product, a convolution, a lookup."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 256)).astype("float32")
    ids = rng.integers(0, 40, (8, 7)).astype("int32")
    images = rng.normal(size=(4, 6, 6, 3)).astype("float32")

    def dense(name="d"):
        i = keras.Input((256,))
        return keras.Model(i, keras.layers.Dense(2, name="head")(keras.layers.Dense(256, name=name)(i)))

    def einsum():
        i = keras.Input((256,))
        h = keras.layers.EinsumDense("ab,bcd->acd", (4, 8), name="d")(i)
        return keras.Model(i, keras.layers.Flatten()(h))

    def conv():
        i = keras.Input((6, 6, 3))
        return keras.Model(i, keras.layers.Flatten()(keras.layers.Conv2D(5, 3, name="d")(i)))

    def table(tied=False):
        i = keras.Input((7,), dtype="int32")
        if tied:
            emb = keras.layers.ReversibleEmbedding(40, 6, name="tok")
            return keras.Model(i, emb(emb(i), reverse=True))
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(40, 6, name="tok")(i))
        return keras.Model(i, keras.layers.Dense(2, name="head")(h))

    scattered = np.eye(256, dtype=bool)[rng.permutation(256)]
    some_of_rows = np.zeros((40, 6), bool)
    some_of_rows[[3, 17, 30], :5] = True  # 6 % of the table: its rows (more would be its elements)
    heads = np.zeros((256, 4, 8), bool)
    heads[:, 1] = True
    return [
        ("columns", dense, "d/kernel[:, 10:20]", None, x),
        ("rows, an index list", dense, "d/kernel[[1, 5, 9]]", None, x),
        ("scattered elements", dense, "d/kernel", scattered, x),
        ("a head of an EinsumDense", einsum, "d/kernel", heads, x),
        ("output channels of a convolution", conv, "d/kernel[..., 1:3]", None, images),
        ("new rows of a table", table, "tok/embeddings[35:]", None, ids),
        ("rows of a table, an index list", table, "tok/embeddings[[1, 7, 30]]", None, ids),
        ("elements of rows of a table", table, "tok/embeddings", some_of_rows, ids),
        ("rows of a tied table", lambda: table(tied=True), "tok/embeddings[35:]", None, ids),
    ]


#: the sliced calls whose backward computes no ``autograd.grad`` (a block's product does: Dynamo splits there)
TRACED_WHOLE = (
    "scattered elements",
    "new rows of a table",
    "rows of a table, an index list",
    "elements of rows of a table",
)


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile's tracing (Dynamo)")
@pytest.mark.parametrize("case", [c for c in _compiled_cases() if c[0] in TRACED_WHOLE], ids=lambda c: c[0])
def test_torch_compile_traces_a_sliced_call_and_its_backward_whole(case):
    """``torch.compile(fullgraph=True)`` traces the call, and the backward its autograd function speculates, in one graph.

    A graph break inside the step split every compiled step there (the
    backend module chosen behind ``functools.cache``, whose wrapper Dynamo
    traces into an import; a class made inside the step; a NumPy index an
    op converts; a dict filled in the step), and a break in a scattered
    kernel's backward ran its rest as a frame of its own, which PyTorch 2.13
    fails to compile again at a new batch size (``IndexError`` in
    ``pgo.is_stride_dynamic``: a value in it is a view of a sparse tensor).
    The compiled step's gradient of the stand-in is the eager one's, within :data:`BOUND`.
    """
    import torch

    name, build, rows, mask, data = case
    keras.utils.set_random_seed(2)
    m = build()
    variable = rows.split("[")[0]
    frz = ff.Freezer(m, ff.Plan([ff.freeze(variable), ff.train(rows, mask=mask)]), gradients="sliced")
    assert {v["path"]: v["gradient"] for v in frz.report()["variables"]}[variable] in ("sliced", "sampled"), name
    standin = m.get_layer(variable.split("/")[0]).__dict__[MARK].standin.value

    def loss(t):
        return (m(t, training=True) ** 2).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):  # fullgraph: a graph break raises
        standin.grad = None
        fn(torch.as_tensor(data)).backward()
        grads.append(standin.grad.detach().cpu().numpy().copy())
    eager, compiled = grads
    assert eager.shape == compiled.shape and np.abs(eager).max() > 0, name
    assert np.abs(compiled - eager).max() <= BOUND * np.abs(eager).max(), name


@pytest.mark.skipif(BACKEND != "torch", reason="torch.compile's recompilation at a new batch size")
def test_a_compiled_torch_fit_at_a_new_batch_size_keeps_the_frozen_elements():
    """``jit_compile=True`` trains every kind of sliced call, compiled again at a second batch size, frozen bytes kept."""
    for name, build, rows, mask, data in _compiled_cases():
        keras.utils.set_random_seed(2)
        m = build()
        variable = rows.split("[")[0]
        frz = ff.Freezer(m, ff.Plan([ff.freeze(variable), ff.train(rows, mask=mask)]), gradients="sliced")
        kernel = next(w for w in m.weights if w.path == variable)
        before = np.array(keras.ops.convert_to_numpy(kernel))
        target = np.zeros((len(data),) + tuple(m.output.shape[1:]), "float32")
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=True)
        for batch in (4, 2):
            m.fit(data, target, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        after = np.array(keras.ops.convert_to_numpy(kernel))
        frozen = frz.frozen_mask(variable)
        assert np.array_equal(after[frozen], before[frozen]), name
        assert (after[~frozen] != before[~frozen]).any(), name
        frz.verify()
