"""Scattered trained elements of a ``Dense`` kernel get the sampled product: the gradient at those elements only.

No block holds a permutation matrix (every row and every column has one
trained element), so the sliced path has nothing smaller than the kernel to
multiply. The sampled product computes ``sum(x[:, i] * dy[:, j])`` over the
batch for each trained ``(i, j)`` instead of the whole ``x.T @ dy``. The
references: plain Keras's gradient of the same model, and the dense path
(``gradients="dense"``). Trained values may differ from them by float
rounding only (:data:`BOUND`); frozen ones are bit-identical.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, FIT_MODES, gradients, squares_gradients, strategy_of, weights_of
from finefreeze._resolve.standins import kernel_of
from finefreeze._slices.choose import AUTO_SAMPLES, MARK, choose, kernel_sample, kernel_slice, pays, sampled_equation
from test_slices import _product_sizes, trained

#: the largest difference of a trained value from the references, relative to the variable's largest value
BOUND = 2e-5

N = 256  # a Dense(256) kernel on 256 inputs: 65,536 elements, the fewest ``auto`` slices
RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, N)).astype("float32")
Y = RNG.normal(size=(48, 4)).astype("float32")
SCATTERED = np.eye(N, dtype=bool)[RNG.permutation(N)]  # 0.39 % of the kernel, one in every row and column


def model(seed=3):
    keras.utils.set_random_seed(seed)
    i = keras.Input((N,))
    h = keras.layers.Dense(N, activation="tanh", name="d")(i)
    return keras.Model(i, keras.layers.Dense(4, name="head")(h), name="m")


def plan(mask=SCATTERED):
    return ff.Plan([ff.freeze("**/d/kernel"), ff.train("**/d/kernel", mask=mask)])


def numpy(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def close(a, ref, what):
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(a - ref).max()) <= BOUND * scale, (what, float(np.abs(a - ref).max()) / scale)


def gradient_kind(frz, path):
    return {v["path"]: v["gradient"] for v in frz.report()["variables"]}[path]


def fit(p, gradients="sliced", epochs=2, **compile_kw):
    return trained(model(), p, X, Y, gradients, epochs, **compile_kw)


def test_scattered_elements_are_sampled_and_a_block_that_costs_less_is_sliced():
    d = model().get_layer("d")
    s = kernel_sample(d, d.kernel, ~SCATTERED)
    assert s.kind == "sampled" and s.size == N and s.fraction == 1 / N
    assert s.index[0].tolist() == np.flatnonzero(SCATTERED).tolist()  # the trained elements, in flat order
    assert kernel_slice(d, d.kernel, ~SCATTERED) is None  # no block smaller than the kernel
    assert choose(d, d.kernel, ~SCATTERED, "sliced")[0].kind == "sampled"
    assert choose(d, d.kernel, ~SCATTERED, "dense") == (None, False)
    columns = np.ones((N, N), bool)
    columns[:, :2] = False  # 2 whole columns: a block of 0.8 % costs less than sampling 512 elements
    assert choose(d, d.kernel, columns, "sliced")[0].kind == "dense"
    many = np.ones((N, N), bool)
    many.flat[RNG.choice(N * N, N * N // 10, replace=False)] = False  # 10 %: more than the sampled product takes
    assert kernel_sample(d, d.kernel, many) is None
    einsum = keras.layers.EinsumDense("ab,bc->ac", N)  # EinsumDense kernels are sampled too
    einsum.build((None, N))
    assert kernel_sample(einsum, einsum.kernel, ~SCATTERED).kind == "sampled"
    assert sampled_equation("btd,ndh->btnh") and sampled_equation("btnh,nhd->btd") and sampled_equation("...i,ij->...j")
    assert not sampled_equation("ab,ab->ab")  # an axis both contracted and kept: no column pairs
    for backend, crossover in AUTO_SAMPLES.items():  # auto: by the crossover each backend measured
        assert pays(s, backend) is (s.fraction <= crossover), backend
    assert not pays(s, "numpy")


def test_the_gradient_is_plain_keras_at_the_trained_elements_and_zero_elsewhere():
    m, plain = model(), model()
    frz = ff.Freezer(m, plan(), gradients="sliced")
    assert gradient_kind(frz, "d/kernel") == "sampled"
    x = keras.ops.convert_to_tensor(X[:8])
    assert np.array_equal(numpy(m(x)), numpy(plain(x)))  # the forward: the layer's own, bit for bit
    got, ref, raw = squares_gradients(frz, m, plain, x)  # the kernel, the bias, the head and the kernel's stand-in
    (standin,) = [g for v, g in raw if kernel_of(v) is not None]
    assert tuple(standin.shape) == (N,)  # one value per trained element: nothing else computed
    for v in plain.trainable_weights:
        g, r = got[v.path], ref[v.path]
        if v.path == "d/kernel":
            assert not np.any(g[~SCATTERED])  # never computed: exactly 0
            close(g[SCATTERED], r[SCATTERED], v.path)
        else:
            assert np.array_equal(g, r), v.path  # the input gradient reaching the others is the layer's own


@pytest.mark.parametrize("mode", range(len(FIT_MODES)), ids=[str(m or "default") for m in FIT_MODES])
def test_sampled_kernels_train_as_the_dense_path_does(mode):
    m, frz, before = fit(plan(), **FIT_MODES[mode])
    assert MARK in m.get_layer("d").__dict__ and strategy_of(frz, "d/kernel") == "compact"
    assert "[compact, sampled]" in frz.summary()
    ref, _, _ = fit(plan(), gradients="dense", **FIT_MODES[mode])
    for v, r in zip(weights_of(m), weights_of(ref)):
        assert not np.array_equal(numpy(v), before[v.path]), f"{v.path} did not train"
        close(numpy(v), numpy(r), v.path)


def test_auto_samples_where_the_backend_measured_it_cheaper():
    m, frz, _ = fit(plan(), gradients="auto", epochs=1)
    expected = "sampled" if SCATTERED.mean() <= AUTO_SAMPLES[BACKEND] else "dense"
    assert gradient_kind(frz, "d/kernel") == expected


@pytest.mark.slow
def test_the_full_weight_gradient_is_never_computed():
    """No product of the kernel's size: a check that fails when the dense path is taken (``gradients="dense"``)."""
    layer = keras.layers.Dense(N, use_bias=False)
    x = keras.ops.convert_to_tensor(X[:5])
    layer(x)
    for gradients_, expected in (("dense", True), ("sliced", False)):
        frz = ff.Freezer(layer, ff.Plan([ff.freeze("**"), ff.train("**/kernel", mask=SCATTERED)]), gradients=gradients_)
        assert (N * N in _product_sizes(layer, x)) is expected, gradients_
        del frz


def test_plan_changes_between_sampled_elements_slices_and_the_dense_path_keep_training_exact():
    m, frz, _ = fit(plan(), epochs=1)
    anti = np.fliplr(SCATTERED)  # other elements, the same count
    many = np.zeros((N, N), bool)
    many.flat[RNG.choice(N * N, N * N // 10, replace=False)] = True
    steps = [
        (plan(anti), "sampled"),  # other elements: a new product
        (ff.Plan([ff.freeze("**/d/kernel"), ff.train("**/d/kernel[:, :8]")]), "sliced"),
        (plan(many), "dense"),  # 10 %: no block, too many to sample
        (plan(), "sampled"),
    ]
    for p, kind in steps:
        before = {v.path: numpy(v) for v in weights_of(m)}
        frz.update(p)
        assert frz.history[-1]["retraced"] and gradient_kind(frz, "d/kernel") == kind
        m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        for v in weights_of(m):
            frozen = frz.frozen_mask(v.path)
            assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
            assert not np.array_equal(numpy(v)[~frozen], before[v.path][~frozen]), v.path


def test_a_model_saved_while_sampled_elements_train_resumes_as_the_same_run(tmp_path):
    m, frz, _ = fit(plan(), epochs=1)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert not any("call" in layer.__dict__ for layer in loaded.layers)  # plain Keras layers in the file
    again = ff.Freezer.of(loaded)
    assert gradient_kind(again, "d/kernel") == "sampled"
    loaded.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    m.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # the run that was not interrupted
    again.verify()
    for v, w in zip(weights_of(loaded), weights_of(m)):
        assert np.array_equal(numpy(v), numpy(w)), v.path


def test_mixed_precision_sampled_elements_round_no_worse_than_the_dense_path():
    """float16 inputs: summed in float32 here, by the backend's half-precision matmul on the dense path.

    Either float16 run is off the float32 run by float16 rounding that
    Adam's normalisation amplifies (measured on TensorFlow: 0.5 % sampled,
    1.4 % dense, of the largest value); the sampled one is within twice the
    dense path's distance (on JAX and PyTorch the two are equal).
    """
    exact, _, _ = fit(plan(), gradients="dense", epochs=1)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        m, frz, _ = fit(plan(), epochs=1)
        assert gradient_kind(frz, "d/kernel") == "sampled"
        ref, _, _ = fit(plan(), gradients="dense", epochs=1)
    finally:
        keras.config.set_dtype_policy("float32")
    for v, r, e in zip(weights_of(m), weights_of(ref), weights_of(exact)):
        scale = max(float(np.abs(numpy(e)).max()), 1e-30)
        sampled, dense = (float(np.abs(numpy(a) - numpy(e)).max()) / scale for a in (v, r))
        assert sampled <= 2 * dense + 1e-6, (v.path, sampled, dense)


def test_half_precision_inputs_are_summed_in_float32_as_a_matmul_sums_them():
    """Over 4,096 rows a float16 running sum would drift by far more than the one rounding of its result."""
    from finefreeze._slices.sampled import Sampled

    flat = np.flatnonzero(SCATTERED)
    rows, cols = np.nonzero(SCATTERED)
    x = RNG.normal(size=(4096, N)).astype("float16")
    dy = RNG.normal(size=(4096, N)).astype("float16")
    product = Sampled("...i", "ij", "...j", (N, N), len(flat))
    got = numpy(product.weight_gradient(*map(keras.ops.convert_to_tensor, (x, dy, flat.astype("int32")))))
    exact = (x.astype(np.float64).T @ dy.astype(np.float64))[rows, cols]
    assert got.dtype == np.float32  # the float32 sums, cast once to the stand-in's dtype by the tap
    assert float(np.abs(got.astype(np.float16).astype(np.float64) - exact).max()) <= 2**-10 * float(np.abs(exact).max())


def test_a_custom_loop_trains_sampled_elements_as_the_dense_path_does_and_a_delta_rebuilds_it(tmp_path):
    x, y = (keras.ops.convert_to_tensor(a[:16]) for a in (X, Y))
    runs = {}
    for gradients_ in ("sliced", "dense"):
        m = model()
        frz = ff.Freezer(m, plan(), gradients=gradients_)
        before = numpy(m.get_layer("d").kernel)
        opt = frz.wrap(keras.optimizers.Adam(0.01))
        variables = frz.trainable_variables
        for _ in range(3):
            opt.apply(gradients(lambda m=m: keras.ops.mean(keras.ops.square(m(x) - y)), variables), variables)
        frz.verify()
        assert np.array_equal(numpy(m.get_layer("d").kernel)[~SCATTERED], before[~SCATTERED])
        runs[gradients_] = (m, frz)
    (m, frz), (ref, _) = runs["sliced"], runs["dense"]
    assert gradient_kind(frz, "d/kernel") == "sampled"
    for v, r in zip(weights_of(m), weights_of(ref)):
        close(numpy(v), numpy(r), v.path)
    frz.save_delta(tmp_path / "sampled.safetensors")
    base = model()  # the weights the loop started from
    ff.load_delta(base, tmp_path / "sampled.safetensors")
    for a, b in zip(weights_of(base), weights_of(m)):
        assert np.array_equal(numpy(a), numpy(b)), a.path


@pytest.mark.parametrize("chunk", [48 * 7, 48 * 64])  # 7 elements a chunk (37 chunks, the last padded); 64 (4 chunks)
def test_the_product_in_chunks_gives_each_element_the_sum_it_gives_in_one(monkeypatch, chunk):
    """Chunks run one after another (a map); each element gets its dot product, within the bound.

    (XLA may sum a row of another chunk's shape in another order: not bit for bit on JAX.)
    """
    from finefreeze._slices import sampled

    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(48, N)).astype("float32"), rng.normal(size=(48, N)).astype("float32")
    flat = np.flatnonzero(SCATTERED).astype("int32")
    whole = sampled.Sampled("...a", "ab", "...b", (N, N), flat.size).weight_gradient(x, dy, flat)
    monkeypatch.setattr(sampled, "SAMPLED_CHUNK", chunk)
    chunked = sampled.Sampled("...a", "ab", "...b", (N, N), flat.size).weight_gradient(x, dy, flat)
    whole, chunked = keras.ops.convert_to_numpy(whole), keras.ops.convert_to_numpy(chunked)
    a, b = np.unravel_index(flat, (N, N))
    reference = np.einsum("na,na->a", x[:, a].astype("float64"), dy[:, b].astype("float64"))
    assert whole.shape == chunked.shape == (flat.size,)
    for got in (whole, chunked):
        assert np.max(np.abs(got - reference)) <= BOUND * np.max(np.abs(reference))


@pytest.mark.parametrize("count", [1, 3, 1023, 1024, 1025, 3000])
def test_the_padded_index_gives_each_element_its_own_sum_and_drops_the_repeats(monkeypatch, count):
    """The product reads its index padded (the last element repeated); it returns the ``count`` elements' sums."""
    from finefreeze._slices import sampled

    monkeypatch.setattr(sampled, "SAMPLED_CHUNK", 48 * 256)  # chunks of 256 elements: several past 256
    rng = np.random.default_rng(count)
    x, dy = rng.normal(size=(2, 24, 64)).astype("float32"), rng.normal(size=(2, 24, 96)).astype("float32")
    flat = np.sort(rng.choice(64 * 96, count, replace=False)).astype("int32")
    reads = sampled.padded_index(flat)
    assert reads.dtype == flat.dtype and np.array_equal(reads[:count], flat)
    assert np.all(reads[count:] == flat[-1])
    if count > sampled.INDEX_BLOCK:
        assert reads.size % sampled.INDEX_BLOCK == 0 and reads.size - count < sampled.INDEX_BLOCK
    else:
        assert reads.size == 1 << (count - 1).bit_length()
    got = keras.ops.convert_to_numpy(
        sampled.Sampled("...a", "ab", "...b", (64, 96), count).weight_gradient(x, dy, reads)
    )
    a, b = np.unravel_index(flat, (64, 96))
    reference = np.einsum("na,na->a", x.reshape(48, 64)[:, a].astype("float64"), dy.reshape(48, 96)[:, b])
    assert got.shape == (count,)
    assert np.max(np.abs(got - reference)) <= BOUND * np.max(np.abs(reference))


def test_a_sampled_kernel_holds_its_index_padded_for_the_product():
    """The index the step reads is :func:`padded_index`'s; the stand-in holds the trained elements alone."""
    from finefreeze._slices.sampled import padded_index

    rng = np.random.default_rng(5)
    mask = np.zeros((N, N), bool)
    for _ in range(3):  # three elements in most rows and columns: no block is smaller than the kernel
        mask |= np.eye(N, dtype=bool)[rng.permutation(N)]
    count = int(mask.sum())
    m = model()
    frz = ff.Freezer(m, plan(mask), gradients="sliced")
    assert gradient_kind(frz, "d/kernel") == "sampled"
    (index,) = [w for w in m.non_trainable_weights if w.path.endswith("kernel_trained/index")]
    (standin,) = [w for w in m.trainable_weights if kernel_of(w) is not None]
    assert tuple(standin.shape) == (count,)
    assert np.array_equal(numpy(index), padded_index(np.flatnonzero(mask).astype("int32")))  # 1,024 long


@pytest.mark.skipif(BACKEND != "jax", reason="a jaxpr is JAX's (XLA on a CPU keeps the code of a padding per kernel)")
def test_jax_pads_nothing_in_the_step_when_the_index_is_padded(monkeypatch):
    """The chunks divide the padded index: no concatenation of zeros in the step (the unpadded index has one)."""
    import jax

    from finefreeze._slices import sampled

    monkeypatch.setattr(sampled, "SAMPLED_CHUNK", 48 * 2048)  # 48 tokens: chunks of up to 2,048 elements
    flat = np.sort(np.random.default_rng(2).choice(N * N, 2500, replace=False)).astype("int32")  # read as 3,072
    product = sampled.Sampled("...a", "ab", "...b", (N, N), flat.size)

    def steps(index):
        jaxpr = jax.make_jaxpr(lambda f: product.weight_gradient(X, X, f))(index).jaxpr
        names = [e.primitive.name for e in jaxpr.eqns]
        paddings = [e for e in jaxpr.eqns if e.primitive.name in ("concatenate", "pad") and e.outvars[0].aval.ndim == 1]
        return names, paddings

    names, paddings = steps(sampled.padded_index(flat))
    assert "scan" in names or "while" in names, names  # 3 chunks of 1,024 in a loop
    assert not paddings, paddings
    assert steps(flat)[1], "the unpadded index is padded in the step: the check sees it"


def sampled_chain(layers: int, width: int, seed: int, more=lambda j: 0, activation=None):
    """``layers`` Dense(width) layers and a plan training scattered elements of each kernel (the sampled product).

    Each kernel trains one element in every row and column (no block is
    smaller than the kernel) and ``more(j)`` more at random.
    """
    keras.utils.set_random_seed(seed)
    i = keras.Input((width,))
    h = i
    for j in range(layers):
        h = keras.layers.Dense(width, activation=activation, name=f"d{j}")(h)
    rng = np.random.default_rng(seed)
    rules = [ff.freeze("**/kernel")]
    for j in range(layers):
        mask = np.eye(width, dtype=bool)[rng.permutation(width)].reshape(-1)
        mask[rng.choice(np.flatnonzero(~mask), more(j), replace=False)] = True
        rules.append(ff.train(f"**/d{j}/kernel", mask=mask.reshape(width, width)))
    return keras.Model(i, h), ff.Plan(rules)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX compiles a program for each shape of array it makes, and keeps it")
def test_jax_compiles_nothing_per_kernel_for_a_plans_variables():
    """Kernels each training a number of elements of its own: their variables and Adam's state of them compile nothing.

    ``jnp.asarray`` of a host array and ``jnp.zeros`` compile a program for
    each shape, and JAX keeps every one (1.4 MB apiece on a CPU): two per
    partially trained kernel made 160 MB of a 152 M-parameter LLM's peak.
    """
    import jax

    lowered = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    def programs(kernels: int, seed: int) -> int:
        m, chain_plan = sampled_chain(kernels, N, seed, more=lambda j: 7 * j + seed)  # a length of its own each
        lowered.clear()
        frz = ff.Freezer(m, chain_plan, gradients="sliced")
        assert {gradient_kind(frz, f"d{j}/kernel") for j in range(kernels)} == {"sampled"}
        frz.wrap(keras.optimizers.Adam()).build(m.trainable_variables)
        return len(lowered)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        programs(1, seed=10)  # what any plan compiles once (the first of its kind) is compiled here
        one, six = programs(1, seed=11), programs(6, seed=12)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert six <= one, f"{one} programs for 1 kernel, {six} for 6: the plan's variables compile per kernel"


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's schedule of JAX's compiled step")
def test_jax_transposes_a_sampled_kernels_input_in_the_backward_pass():
    """Each layer's input is held for the backward pass once, not also as its transpose.

    The sampled product gathers rows of the transposed input; made from the
    input alone, XLA made every layer's transpose during the forward pass
    and held it to the layer's backward: one more input's worth of the
    step's temporaries per layer.
    """
    import jax

    width, tokens = 512, 256

    def temporaries(layers: int) -> int:
        m, chain_plan = sampled_chain(layers, width, seed=1, activation="tanh")
        frz = ff.Freezer(m, chain_plan, gradients="sliced")
        assert {gradient_kind(frz, f"d{j}/kernel") for j in range(layers)} == {"sampled"}
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
        x = np.random.default_rng(0).normal(size=(tokens, width)).astype("float32")
        m.train_on_batch(x, x)
        groups = (m.trainable_variables, m.non_trainable_variables, m.optimizer.variables, m.metrics_variables)
        state = tuple([v.value for v in vs] for vs in groups)
        compiled = jax.jit(m.train_step, donate_argnums=0).lower(state, (x, x, None)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    per_layer = (temporaries(6) - temporaries(2)) / 4 / (tokens * width * 4)  # in inputs' worth
    assert per_layer < 1.5, f"{per_layer:.2f} inputs' worth of temporaries per layer: its transpose is held too"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.map_fn's parallel iterations are TensorFlow's")
def test_tensorflow_runs_the_chunks_one_after_another(monkeypatch):
    """Each chunk holds its gathers of ``x`` and ``dy``: ten at once (``keras.ops.map``'s default) cost ten chunks."""
    import tensorflow as tf

    from finefreeze._slices import sampled

    monkeypatch.setattr(sampled, "SAMPLED_CHUNK", 48 * 7)
    flat = np.flatnonzero(SCATTERED).astype("int32")
    product = sampled.Sampled("...a", "ab", "...b", (N, N), flat.size)
    step = tf.function(lambda: product.weight_gradient(X, X, flat))
    loops = [op for op in step.get_concrete_function().graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops, "the chunks run in a loop"
    assert all(op.get_attr("parallel_iterations") == 1 for op in loops)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graph executor runs an operation once it can")
def test_tensorflow_transposes_a_sampled_kernels_input_once_its_output_gradient_exists():
    """The executor runs an operation as soon as its inputs exist: the transpose of ``x`` alone, every
    layer's at the start of the backward pass, each held until its layer's product ran."""
    import tensorflow as tf

    from finefreeze._slices import sampled

    flat = np.flatnonzero(SCATTERED).astype("int32")
    product = sampled.Sampled("...a", "ab", "...b", (N, N), flat.size)
    spec = tf.TensorSpec((None, N), tf.float32)
    graph = tf.function(lambda x, dy: product.weight_gradient(x, dy, flat)).get_concrete_function(spec, spec).graph
    x, dy = (t.op for t in graph.inputs[:2])

    def waits_for(op) -> set:
        """Every operation ``op`` waits for: its inputs' and its control inputs', all the way back."""
        seen, todo = set(), [op]
        while todo:
            o = todo.pop()
            for before in [t.op for t in o.inputs] + list(o.control_inputs):
                if before not in seen:
                    seen.add(before)
                    todo.append(before)
        return seen

    of_x = [op for op in graph.get_operations() if op.type == "Transpose" and x in waits_for(op)]
    assert of_x, "the product gathers rows of x's transpose"
    assert all(dy in waits_for(op) for op in of_x), "x's transpose can run before dy exists"


@pytest.mark.parametrize(
    "x_spec, k_spec, y_spec, transposed, variable_letters, order",
    [
        ("...a", "ab", "...b", False, "ab", "a"),  # Dense: the variable's flat order is by input, then output
        ("...a", "ab", "...b", True, "ba", "b"),  # a tied table's reverse projection: by output, then input
        ("...a", "bac", "...bc", False, "bac", None),  # an einsum whose axes interleave x's and y's
    ],
)
def test_each_elements_sum_whatever_order_the_variable_lists_them_in(
    x_spec, k_spec, y_spec, transposed, variable_letters, order
):
    """The elements' flat indices are the variable's; the product pairs them with x's and dy's columns right."""
    from finefreeze._slices import sampled

    dims = {"a": 6, "b": 5, "c": 4}
    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 8, dims["a"])).astype("float32")
    dy = rng.normal(size=(3, 8, *(dims[c] for c in y_spec[3:]))).astype("float32")
    variable_shape = tuple(dims[c] for c in variable_letters)
    flat = np.sort(rng.choice(int(np.prod(variable_shape)), 23, replace=False)).astype("int32")
    product = sampled.Sampled(x_spec, k_spec, y_spec, tuple(dims[c] for c in k_spec), flat.size, transposed)
    assert product.order == order
    got = keras.ops.convert_to_numpy(product.weight_gradient(x, dy, flat))
    whole = np.einsum(f"nta,nt{y_spec[3:]}->{variable_letters}", x.astype("float64"), dy.astype("float64"))
    reference = whole.reshape(-1)[flat]
    assert got.shape == (flat.size,)
    assert np.max(np.abs(got - reference)) <= BOUND * np.max(np.abs(reference))
