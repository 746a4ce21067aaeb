"""New rows of an embedding train at the cost of those rows: the same training, the frozen rows bit for bit.

With ``gradients="sliced"`` an ``Embedding`` whose trained elements lie in
some rows (new tokens) gets the gradient of those rows only on JAX and
PyTorch (the batch's ``dy`` summed per id; PyTorch hands it over as a sparse
tensor), and TensorFlow reads its table sparsely, whatever the mode, so that
its own sparse gradient never costs a copy of the table. The references: the
dense path (``gradients="dense"``) and plain Keras training the new rows as
an embedding of their own. Trained values may differ by float rounding only
(the sum over a row's ids may run in another order): :data:`BOUND`.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, FIT_MODES, as_kernel_gradients, gradients, strategy_of, weights_of
from finefreeze._slices.choose import MARK

BOUND = 2e-5  # of the variable's largest value, as in test_slices.py
VOCAB, DIM, NEW = 40, 6, 5
RNG = np.random.default_rng(1)
IDS = RNG.integers(0, VOCAB, (64, 7)).astype("int32")
IDS[:, :2] = RNG.integers(VOCAB - NEW, VOCAB, (64, 2))  # every batch holds new tokens
IDS[:, 2] = 3  # and one of the rows of an index list
Y = RNG.normal(size=(64, 2)).astype("float32")
TRAINED = {"range": f"**/tok/embeddings[{VOCAB - NEW}:]", "index list": "**/tok/embeddings[[3, 11, 30]]"}


def model(seed=2):
    keras.utils.set_random_seed(seed)
    i = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, name="tok")(i)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(i, keras.layers.Dense(2, name="head")(h), name="m")


def numpy(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def close(a, ref, what):
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(a - ref).max()) <= BOUND * scale, (what, float(np.abs(a - ref).max()) / scale)


def fit(rows, gradients="sliced", strategy="auto", optimizer=None, **compile_kw):
    m = model()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/tok/**"), ff.train(rows)]), gradients=gradients, strategy=strategy)
    table = numpy(m.get_layer("tok").embeddings)
    m.compile(optimizer=frz.wrap(optimizer or keras.optimizers.Adam(0.01)), loss="mse", **compile_kw)
    m.fit(IDS, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    frz.verify()
    frozen = frz.frozen_mask("tok/embeddings")
    after = numpy(m.get_layer("tok").embeddings)
    assert np.array_equal(after[frozen], table[frozen])  # the same bytes
    assert not np.array_equal(after[~frozen], table[~frozen]), "the new rows did not train"
    return m, frz


def sliced_here(layer):
    mark = layer.__dict__.get(MARK)
    return mark is not None and mark.sliced


CASES = [("range", m) for m in range(len(FIT_MODES))] + [("index list", 1)]


@pytest.mark.parametrize("rows, mode", CASES, ids=[f"{r}-{FIT_MODES[m] or 'default'}" for r, m in CASES])
def test_new_rows_train_as_the_dense_path_does(rows, mode):
    m, frz = fit(TRAINED[rows], **FIT_MODES[mode])
    assert sliced_here(m.get_layer("tok")) and strategy_of(frz, "tok/embeddings") == "compact"
    ref, _ = fit(TRAINED[rows], gradients="dense", **FIT_MODES[mode])
    # TensorFlow reads the table sparsely on the dense path too (the same gradient); elsewhere it is Keras' call
    assert (MARK in ref.get_layer("tok").__dict__) is (BACKEND == "tensorflow")
    assert not sliced_here(ref.get_layer("tok"))
    for v, r in zip(weights_of(m), weights_of(ref)):
        close(numpy(v), numpy(r), v.path)


def test_new_rows_train_as_plain_keras_trains_them_as_an_embedding_of_their_own():
    """The reference: a frozen table of the old rows and a trained one of the new, picked per id."""
    m, _ = fit(TRAINED["range"], optimizer=keras.optimizers.SGD(0.5))
    keras.utils.set_random_seed(2)
    start = model()
    table = numpy(start.get_layer("tok").embeddings)
    i = keras.Input((7,), dtype="int32")
    old = keras.layers.Embedding(VOCAB - NEW, DIM, trainable=False, name="old")
    new = keras.layers.Embedding(NEW, DIM, name="new")
    is_new = keras.ops.expand_dims(keras.ops.greater_equal(i, VOCAB - NEW), -1)
    picked = keras.ops.where(
        is_new, new(keras.ops.maximum(i - (VOCAB - NEW), 0)), old(keras.ops.minimum(i, VOCAB - NEW - 1))
    )
    h = keras.layers.GlobalAveragePooling1D()(picked)
    ref = keras.Model(i, keras.layers.Dense(2, name="head")(h))
    old.set_weights([table[: VOCAB - NEW]])
    new.set_weights([table[VOCAB - NEW :]])
    ref.get_layer("head").set_weights(start.get_layer("head").get_weights())
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    ref.fit(IDS, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    close(numpy(m.get_layer("tok").embeddings)[VOCAB - NEW :], numpy(new.embeddings), "new rows")
    for a, b in zip(weights_of(m.get_layer("head")), weights_of(ref.get_layer("head"))):
        close(numpy(a), numpy(b), a.path)


def table_sized(layer, ids, variables):
    """Whether the gradient of the table (and its stand-in) computes anything the size of the table.

    TensorFlow: an operation with a table-shaped output other than the read
    of the variable (which shares its buffer); JAX: a scatter-add into a
    table-sized array (the lookup's dense gradient); PyTorch: a dense gradient.
    """
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda: gradients(lambda: keras.ops.sum(layer(ids) ** 2), variables))
        ops = step.get_concrete_function().graph.get_operations()
        shape = list(layer.embeddings.shape)
        aliases = ("ReadVariableOp", "StopGradient")  # share the variable's buffer
        return any(o.type not in aliases and any(t.shape.as_list() == shape for t in o.outputs) for o in ops)
    if BACKEND == "jax":
        import jax

        def loss(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return keras.ops.sum(layer(ids) ** 2)

        text = str(jax.make_jaxpr(jax.grad(loss))([v.value for v in variables]))
        rows, dim = layer.embeddings.shape
        return any("scatter-add" in ln and f"f32[{rows},{dim}]" in ln.split("=")[0] for ln in text.splitlines())
    grads = gradients(lambda: keras.ops.sum(layer(ids) ** 2), variables)
    return any(g is not None and tuple(g.shape) == tuple(layer.embeddings.shape) for g in grads)


def test_the_gradient_of_the_table_costs_the_batch_not_the_table():
    """A check that fails on the dense path (``gradients="dense"``) where that path is table-sized.

    TensorFlow's own gradient of a lookup is ``IndexedSlices`` of the batch's
    rows: its dense path is not table-sized either (``test_embedding_rows``
    sees restore's densified gradient fail the same check).
    """
    ids = keras.ops.convert_to_tensor(IDS[:4])
    for gradients_, expected in (("dense", BACKEND != "tensorflow"), ("sliced", False)):
        layer = keras.layers.Embedding(VOCAB, DIM)
        layer.build()
        plan = ff.Plan([ff.freeze("**"), ff.train(f"**/embeddings[{VOCAB - NEW}:]")])
        frz = ff.Freezer(layer, plan, gradients=gradients_)
        variables = frz.trainable_variables  # the table, and its stand-in while the lookup slices it
        assert len(variables) == (2 if gradients_ == "sliced" else 1)
        assert table_sized(layer, ids, variables) is expected, gradients_
        grads = gradients(lambda layer=layer: keras.ops.sum(layer(ids) ** 2), variables)
        g = as_kernel_gradients(frz, variables, grads)[layer.embeddings.path]
        if gradients_ == "sliced":
            assert not g[: VOCAB - NEW].any() and g[VOCAB - NEW :].any()  # exact zeros outside the new rows
        else:
            assert g[: VOCAB - NEW].any(), "Keras' gradient reaches the old rows"
        del frz


def test_plan_changes_move_the_rows_and_end_the_slice():
    m = model()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/tok/**"), ff.train(TRAINED["range"])]), gradients="sliced")
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    m.fit(IDS, Y, batch_size=16, epochs=1, verbose=0)
    layer = m.get_layer("tok")
    assert layer.__dict__[MARK].slice.index[0].tolist() == list(range(VOCAB - NEW, VOCAB))
    for rows in (f"**/tok/embeddings[{VOCAB - 2 * NEW}:]", "**/tok/embeddings[:, 0]"):
        before = numpy(layer.embeddings)
        frz.update(ff.Plan([ff.freeze("**/tok/**"), ff.train(rows)]))
        m.fit(IDS, Y, batch_size=16, epochs=1, verbose=0)
        frozen = frz.frozen_mask("tok/embeddings")
        assert np.array_equal(numpy(layer.embeddings)[frozen], before[frozen])
        frz.verify()
    assert not sliced_here(layer)  # a column of every row: no block of rows, the dense gradient


@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_a_custom_loop_with_clipping_takes_the_rows_gradient_with_either_strategy(strategy):
    """The gradient a custom loop gets (sparse on PyTorch) goes through clipping and either strategy."""
    refs = {}
    for gradients_ in ("sliced", "dense"):
        m = model()
        frz = ff.Freezer(
            m, ff.Plan([ff.freeze("**/tok/**"), ff.train(TRAINED["range"])]), gradients=gradients_, strategy=strategy
        )
        opt = frz.wrap(keras.optimizers.Adam(0.01, clipnorm=0.05))
        table = numpy(m.get_layer("tok").embeddings)
        variables = frz.trainable_variables
        for _ in range(3):
            grads = gradients(lambda m=m: keras.ops.mean((m(IDS) - keras.ops.convert_to_tensor(Y)) ** 2), variables)
            opt.apply_gradients(zip(grads, variables))
        frz.verify()
        after = numpy(m.get_layer("tok").embeddings)
        assert np.array_equal(after[: VOCAB - NEW], table[: VOCAB - NEW])
        refs[gradients_] = [numpy(v) for v in weights_of(m)]
    for a, b in zip(*refs.values()):
        close(a, b, strategy)


@pytest.mark.slow
def test_mixed_precision_rows_train_as_the_dense_path_does():
    keras.config.set_dtype_policy("mixed_float16")
    try:
        m, _ = fit(TRAINED["range"])
        ref, _ = fit(TRAINED["range"], gradients="dense")
    finally:
        keras.config.set_dtype_policy("float32")
    assert m.get_layer("tok").embeddings.dtype == "float32"
    for v, r in zip(weights_of(m), weights_of(ref)):
        scale = max(float(np.abs(numpy(r)).max()), 1e-30)
        assert float(np.abs(numpy(v) - numpy(r)).max()) <= 2e-3 * scale, v.path  # float16 activations


def test_the_report_and_the_summary_say_how_each_gradient_is_computed():
    m = model()
    plan = ff.Plan([ff.freeze("**"), ff.train(TRAINED["range"]), ff.train("**/head/kernel[:, :1]")])
    frz = ff.Freezer(m, plan, gradients="sliced")
    got = {v["path"]: v["gradient"] for v in frz.report()["variables"]}
    assert got["tok/embeddings"] == "sliced"  # the stand-in takes the new rows; TensorFlow hands it IndexedSlices
    assert got["head/kernel"] == "sliced" and got["head/bias"] is None  # frozen: no gradient
    assert "[compact, sliced]" in frz.summary(detail=True)
    dense = ff.Freezer(model(), plan, gradients="dense")
    assert {v["gradient"] for v in dense.report()["variables"]} <= {"dense", "sparse", None}
    assert "sliced]" not in dense.summary(detail=True)


def test_a_reversible_embedding_tied_to_the_output_trains_its_rows_as_the_dense_path_does():
    """KerasHub's token embedding: the lookup sliced, the reverse projection (tied weights) Keras' own."""
    got = {}
    for gradients_ in ("sliced", "dense"):
        keras.utils.set_random_seed(4)
        i = keras.Input((7,), dtype="int32")
        emb = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=True, mask_zero=True, name="tok")
        h = keras.layers.GlobalAveragePooling1D()(emb(i))
        m = keras.Model(i, emb(h, reverse=True))
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train(TRAINED["range"])]), gradients=gradients_)
        assert sliced_here(emb) is (gradients_ == "sliced")
        table = numpy(emb.embeddings)
        m.compile(
            optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss=keras.losses.SparseCategoricalCrossentropy(True)
        )
        m.fit(IDS, IDS[:, 0], batch_size=16, epochs=2, shuffle=False, verbose=0)
        frz.verify()
        after = numpy(emb.embeddings)
        assert np.array_equal(after[: VOCAB - NEW], table[: VOCAB - NEW])
        assert not np.array_equal(after[VOCAB - NEW :], table[VOCAB - NEW :])
        got[gradients_] = after
    close(got["sliced"], got["dense"], "tied table")


@pytest.mark.parametrize("gradients_", ["sliced", "dense"])
def test_tied_new_rows_take_the_gradient_written_out_by_hand(gradients_):
    """One SGD step on the new rows of a tied table equals the gradient written out in NumPy.

    logits = h · Eᵀ with h the mean of the looked-up rows: the trained rows' gradient is the output
    projection's ``dlogits[:, rows]ᵀ · h`` plus the lookup's ``dh / T`` for every position that reads
    them. Guards both paths against being wrong the same way (the test above compares them).
    """
    keras.utils.set_random_seed(6)
    i = keras.Input((7,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=True, name="tok")
    m = keras.Model(i, emb(keras.layers.GlobalAveragePooling1D()(emb(i)), reverse=True))
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train(TRAINED["range"])]), gradients=gradients_)
    lr, ids, y = 0.5, IDS[:16], IDS[:16, 0]
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(lr)), loss=keras.losses.SparseCategoricalCrossentropy(True))
    table = numpy(emb.embeddings)
    m.train_on_batch(ids, y)
    e = table.astype(np.float64)
    h = e[ids].mean(axis=1)  # (B, D)
    logits = h @ e.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dlogits = (p - np.eye(VOCAB)[y]) / len(y)  # mean cross-entropy
    grad = dlogits.T @ h  # the output projection's share
    dh = dlogits @ e
    np.add.at(grad, ids.reshape(-1), np.repeat(dh / ids.shape[1], ids.shape[1], axis=0))  # the lookup's share
    want = e - lr * grad
    after = numpy(emb.embeddings)
    assert np.array_equal(after[: VOCAB - NEW], table[: VOCAB - NEW])  # frozen rows: bit for bit
    np.testing.assert_allclose(after[VOCAB - NEW :], want[VOCAB - NEW :], rtol=0, atol=2e-6)
    assert not np.allclose(after[VOCAB - NEW :], table[VOCAB - NEW :], rtol=0, atol=1e-4)  # they moved


def test_negative_ids_count_from_the_end_as_keras_take_does():
    """``-1`` is the last row for Keras' lookup: the same output, and the last row trains, on every path."""
    ids = IDS.copy()
    ids[:, 3] = -1
    got = {}
    for gradients_ in ("sliced", "dense"):
        m = model()
        plain_out = numpy(m(ids[:2]))  # Keras' own lookup, before any Freezer
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**/tok/**"), ff.train(TRAINED["range"])]), gradients=gradients_)
        assert np.array_equal(numpy(m(ids[:2])), plain_out)
        last = numpy(m.get_layer("tok").embeddings)[-1]
        m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.5)), loss="mse")
        m.fit(ids, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        got[gradients_] = numpy(m.get_layer("tok").embeddings)
        assert not np.array_equal(got[gradients_][-1], last), "the last row did not train"
    close(got["sliced"], got["dense"], "table")


@pytest.mark.slow
def test_a_loss_scale_optimizer_around_the_wrapper_gets_gradients_it_can_check():
    """Keras' LossScaleOptimizer checks every gradient densely: PyTorch's rows then arrive dense."""
    got = {}
    for gradients_ in ("sliced", "dense"):
        m = model()
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**/tok/**"), ff.train(TRAINED["range"])]), gradients=gradients_)
        table = numpy(m.get_layer("tok").embeddings)
        m.compile(optimizer=keras.optimizers.LossScaleOptimizer(frz.wrap(keras.optimizers.Adam(0.01))), loss="mse")
        m.fit(IDS, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        got[gradients_] = numpy(m.get_layer("tok").embeddings)
        assert np.array_equal(got[gradients_][: VOCAB - NEW], table[: VOCAB - NEW])
    close(got["sliced"], got["dense"], "table")


def test_a_delta_file_of_sliced_rows_rebuilds_the_tuned_model_bit_for_bit(tmp_path):
    m, frz = fit(TRAINED["range"])
    assert sliced_here(m.get_layer("tok"))
    frz.save_delta(tmp_path / "rows.safetensors")
    base = model()  # the same seed: the pretrained weights fine-tuning started from
    ff.load_delta(base, tmp_path / "rows.safetensors")
    for a, b in zip(weights_of(base), weights_of(m)):
        assert np.array_equal(numpy(a), numpy(b)), a.path
