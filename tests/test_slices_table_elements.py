"""Scattered elements of an embedding's table train at the cost of the batch: the frozen elements bit for bit.

A table whose trained elements lie in no small block of rows (a ``mask=``
of random elements, a ``select`` at a small budget) gets, with
``gradients="sliced"``, the lookup's gradient at those elements only
(``TableElements``: the batch's ``dy`` summed per id, each element reading
its own) and, tied to the output (KerasHub's ``ReversibleEmbedding``), the
reverse projection's sampled product at them. The references: the dense
path (``gradients="dense"``), plain Keras, and the gradient written out in
NumPy. Trained values may differ by float rounding only: :data:`BOUND`.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, FIT_MODES, gradients, squares_gradients, weights_of
from finefreeze._slices.choose import MARK, choose, kernel_sample, kernel_slice
from test_slices_rows import table_sized

BOUND = 2e-5  # of the variable's largest value, as in test_slices.py
VOCAB, DIM = 300, 64
RNG = np.random.default_rng(5)
SCATTERED = RNG.random((VOCAB, DIM)) < 0.04  # 4 %: every row holds some, no block of rows is small
IDS = RNG.integers(0, VOCAB, (48, 7)).astype("int32")
IDS[:, 0] = -1  # negative ids count from the end, as keras.ops.take counts them
Y = RNG.normal(size=(48, 2)).astype("float32")


def numpy(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def close(a, ref, what):
    scale = max(float(np.abs(ref).max()), 1e-30)
    assert float(np.abs(a - ref).max()) <= BOUND * scale, (what, float(np.abs(a - ref).max()) / scale)


def model(tied: bool, seed=2):
    keras.utils.set_random_seed(seed)
    i = keras.Input((7,), dtype="int32")
    if tied:
        emb = keras.layers.ReversibleEmbedding(VOCAB, DIM, tie_weights=True, name="tok")
        return keras.Model(i, emb(keras.layers.GlobalAveragePooling1D()(emb(i)), reverse=True), name="m")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, DIM, name="tok")(i))
    return keras.Model(i, keras.layers.Dense(2, name="head")(h), name="m")


def plan():
    return ff.Plan([ff.freeze("**/tok/**"), ff.train("**/tok/embeddings", mask=SCATTERED)])


def gradient_kind(frz, path="tok/embeddings"):
    return {v["path"]: v["gradient"] for v in frz.report()["variables"]}[path]


def fit(tied, gradients_="sliced", epochs=2, **compile_kw):
    m = model(tied)
    frz = ff.Freezer(m, plan(), gradients=gradients_)
    table = numpy(m.get_layer("tok").embeddings)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if tied else "mse"
    y = IDS[:, 1] if tied else Y
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss=loss, **compile_kw)
    m.fit(IDS, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    frz.verify()
    after = numpy(m.get_layer("tok").embeddings)
    assert np.array_equal(after[~SCATTERED], table[~SCATTERED])  # the same bytes
    assert (after[SCATTERED] != table[SCATTERED]).any(), "the trained elements did not move"
    return m, frz


def test_scattered_elements_of_a_table_are_its_elements_and_a_small_block_of_rows_stays_rows():
    layer = model(tied=False).get_layer("tok")
    assert kernel_slice(layer, layer.embeddings, ~SCATTERED) is None  # no block smaller than the table
    s = kernel_sample(layer, layer.embeddings, ~SCATTERED)
    assert s.kind == "table elements" and s.index[0].tolist() == np.flatnonzero(SCATTERED).tolist()
    assert choose(layer, layer.embeddings, ~SCATTERED, "sliced")[0].kind == "table elements"
    ks, eligible = choose(layer, layer.embeddings, ~SCATTERED, "auto")  # the default: the dense path is table-sized
    assert ks.kind == "table elements" and eligible
    assert choose(layer, layer.embeddings, ~SCATTERED, "dense") == (None, False)
    rows = np.ones((VOCAB, DIM), bool)
    rows[[4, 90, 200], ::3] = False  # elements of three rows (1 % of them): the rows' gradient, the lookup's own
    assert choose(layer, layer.embeddings, rows, "sliced")[0].kind == "rows"
    half = np.ones((VOCAB, DIM), bool)
    half[::2, ::16] = False  # 3 % of the elements, in half the rows: the elements' gradient, not half the table's
    assert kernel_slice(layer, layer.embeddings, half).fraction == 0.5
    assert choose(layer, layer.embeddings, half, "sliced")[0].kind == "table elements"


@pytest.mark.parametrize("tied", [False, True], ids=["embedding", "tied"])
def test_the_gradient_is_plain_keras_at_the_trained_elements_and_zero_elsewhere(tied):
    m, plain = model(tied), model(tied)
    frz = ff.Freezer(m, plan(), gradients="sliced")
    assert gradient_kind(frz) == "sampled"
    x = keras.ops.convert_to_tensor(IDS[:16])
    assert np.array_equal(numpy(m(x)), numpy(plain(x)))  # the forward: the layer's own, bit for bit
    got, ref, _ = squares_gradients(frz, m, plain, x)
    for v in plain.trainable_weights:
        g, r = got[v.path], ref[v.path]
        if v.path == "tok/embeddings":
            assert not np.any(g[~SCATTERED])  # never computed: exactly 0
            assert g[SCATTERED].any()
            close(g[SCATTERED], r[SCATTERED], v.path)
        else:
            assert np.array_equal(g, r), v.path  # the gradient reaching the others is the layers' own


# PyTorch's sampled sparse product reads the logits' gradient where it lies: no windows to cut
@pytest.mark.slow
@pytest.mark.parametrize("case", ["embedding", "tied"] + (["tied windows"] if BACKEND != "torch" else []))
@pytest.mark.parametrize("mode", range(len(FIT_MODES)), ids=[str(m or "default") for m in FIT_MODES])
def test_table_elements_train_as_the_dense_path_does(mode, case, monkeypatch):
    """``tied windows``: chunks of 64 elements, each reading a window of the logits' gradient's columns."""
    from finefreeze._slices import sampled

    tied, seen = case != "embedding", []
    if case == "tied windows":
        monkeypatch.setattr(sampled, "SAMPLED_CHUNK", 16 * 64)  # batches of 16: chunks of 64 elements
        window = sampled.Sampled.window

        def spied(self, per):
            seen.append((per, window(self, per)))
            return seen[-1][1]

        monkeypatch.setattr(sampled.Sampled, "window", spied)
    m, frz = fit(tied, **FIT_MODES[mode])
    assert MARK in m.get_layer("tok").__dict__ and gradient_kind(frz) == "sampled"
    if case == "tied windows":  # each chunk read a window under half the vocabulary
        assert any(per == 64 and w is not None and 2 * w <= VOCAB for per, w in seen), seen
    ref, _ = fit(tied, gradients_="dense", **FIT_MODES[mode])
    for v, r in zip(weights_of(m), weights_of(ref)):
        close(numpy(v), numpy(r), v.path)


def test_tied_table_elements_take_the_gradient_written_out_by_hand():
    """One SGD step equals the gradient written out in NumPy: the reverse projection's and the lookup's shares."""
    keras.utils.set_random_seed(6)
    m = model(tied=True)
    emb = m.get_layer("tok")
    frz = ff.Freezer(m, plan(), gradients="sliced")
    assert gradient_kind(frz) == "sampled"
    lr, ids, y = 0.5, IDS[:16], IDS[:16, 1]
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(lr)), loss=keras.losses.SparseCategoricalCrossentropy(True))
    table = numpy(emb.embeddings)
    m.train_on_batch(ids, y)
    e = table.astype(np.float64)
    rows = ids % VOCAB  # -1: the last row
    h = e[rows].mean(axis=1)
    logits = h @ e.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dlogits = (p - np.eye(VOCAB)[y]) / len(y)
    grad = dlogits.T @ h
    np.add.at(grad, rows.reshape(-1), np.repeat((dlogits @ e) / ids.shape[1], ids.shape[1], axis=0))
    want = e - lr * grad
    after = numpy(emb.embeddings)
    assert np.array_equal(after[~SCATTERED], table[~SCATTERED])  # frozen elements: bit for bit
    np.testing.assert_allclose(after[SCATTERED], want[SCATTERED], rtol=0, atol=2e-6)
    assert not np.allclose(after[SCATTERED], table[SCATTERED], rtol=0, atol=1e-5)  # they moved


def test_the_gradient_of_the_table_costs_the_batch_not_the_table():
    """A check that fails on the dense path (``gradients="dense"``) where that path is table-sized."""
    ids = keras.ops.convert_to_tensor(IDS[:4])
    for gradients_, expected in (("dense", BACKEND != "tensorflow"), ("sliced", False)):
        layer = keras.layers.Embedding(VOCAB, DIM)
        layer.build()
        frz = ff.Freezer(
            layer, ff.Plan([ff.freeze("**"), ff.train("**/embeddings", mask=SCATTERED)]), gradients=gradients_
        )
        variables = frz.trainable_variables
        assert len(variables) == (2 if gradients_ == "sliced" else 1)
        assert table_sized(layer, ids, variables) is expected, gradients_
        del frz


def test_a_delta_file_of_table_elements_rebuilds_the_tuned_model_bit_for_bit(tmp_path):
    m, frz = fit(tied=True, epochs=1)
    frz.save_delta(tmp_path / "d.safetensors")
    base = model(tied=True)
    ff.load_delta(base, tmp_path / "d.safetensors")
    for v, r in zip(weights_of(base), weights_of(m)):
        assert np.array_equal(numpy(v), numpy(r)), v.path


def _shaped(step_args, fn, shape) -> int:
    """How many values of ``shape`` the traced (TensorFlow, JAX) or eager (PyTorch) step makes."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        def count(g) -> int:
            n = sum(
                1
                for op in g.get_operations()
                for t in op.outputs
                if t.shape.rank == 2 and t.shape.as_list()[0] == shape[0] and t.shape.as_list()[1] in (shape[1], None)
            )
            return n + sum(count(f.graph) for f in g._functions.values() if hasattr(f, "graph"))

        return count(tf.function(fn).get_concrete_function(*step_args).graph)
    if BACKEND == "jax":
        import jax

        def count(jaxpr) -> int:
            n = 0
            for eqn in jaxpr.eqns:
                n += sum(1 for v in eqn.outvars if tuple(getattr(v.aval, "shape", ())) == shape)
                for p in eqn.params.values():
                    for sub in p if isinstance(p, (list, tuple)) else [p]:
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            n += count(inner)
            return n

        return count(jax.make_jaxpr(fn)(*step_args).jaxpr)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Results(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.layout == torch.strided}  # fmt: skip
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.layout == torch.strided and tuple(t.shape) == shape:
                    seen.append(t.untyped_storage().data_ptr() not in inputs)
            return out

    with Results():
        fn(*step_args)
    return sum(seen)


def test_the_tied_projection_transposes_no_more_of_the_logits_gradient_than_the_floor(monkeypatch):
    """A chunk of elements transposes the logits' gradient over the rows it spans, not the whole vocabulary.

    The sampled product gathers each element's column of ``dy`` (tokens x
    vocabulary, the logits' gradient) as a row of its transpose; the
    elements are sorted by their row of the table, so a chunk of them spans
    a few of its rows. A transposed copy of the whole ``dy`` (an LLM's
    logits: 65 MB at 512 tokens of 32,000) is counted here in the traced
    step: the step of scattered elements makes as many as the step with the
    table frozen whole (the floor) makes.
    """
    from finefreeze._slices import sampled

    vocab, dim, batch, tokens = 2000, 32, 4, 16
    monkeypatch.setattr(sampled, "SAMPLED_CHUNK", batch * tokens * 64)  # 64 elements a chunk: 10 chunks
    x = np.random.default_rng(2).integers(0, vocab, (batch, tokens)).astype("int32")

    def made(trained: bool) -> int:
        keras.utils.set_random_seed(0)
        i = keras.Input((tokens,), dtype="int32")
        emb = keras.layers.ReversibleEmbedding(vocab, dim, tie_weights=True, name="tok")
        m = keras.Model(i, emb(keras.layers.LayerNormalization(name="norm")(emb(i)), reverse=True))
        rules = [ff.freeze("**"), ff.train("**/norm/**")]
        if trained:
            rules.append(ff.train("**/tok/embeddings", mask=np.random.default_rng(1).random((vocab, dim)) < 0.01))
        frz = ff.Freezer(m, ff.Plan(rules), gradients="sliced")
        assert not trained or gradient_kind(frz) == "sampled"
        variables = frz.trainable_variables
        inputs = keras.ops.convert_to_tensor(x)
        if BACKEND == "jax":
            import jax

            def loss_of(values):
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    return keras.ops.mean(keras.ops.square(m(inputs)))

            return _shaped([[v.value for v in variables]], jax.grad(loss_of), (vocab, batch * tokens))
        return _shaped([], lambda: gradients(lambda: keras.ops.mean(keras.ops.square(m(inputs))), variables),
                       (vocab, batch * tokens))  # fmt: skip

    floor, elements = made(False), made(True)
    assert elements <= floor, f"{elements - floor} more transposed copies of the logits' gradient than the floor"
