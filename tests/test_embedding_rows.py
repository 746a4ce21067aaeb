"""New embedding rows at their own cost on TensorFlow: compact takes the sparse gradient sparse.

An embedding's gradient arrives as ``IndexedSlices``. ``compact`` hands its
vector of trained elements an ``IndexedSlices`` of the same entries
(``_backends/variables.take_trainable``), so the inner optimizer's sparse
update is the one it gives those elements in the whole table (``restore``),
bit for bit, while state and work are those of the trained rows.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf  # TensorFlow's sparse gradients: the backend-neutral runs leave this file out

import finefreeze as ff
from backend_utils import strategy_of, weights_of

pytestmark = pytest.mark.backends("tensorflow", reason="TensorFlow's IndexedSlices gradients")

VOCAB, DIM, NEW = 300, 8, 6
RNG = np.random.default_rng(0)
X = RNG.integers(0, VOCAB, (48, 5)).astype("int32")
X[:, 0] = RNG.integers(VOCAB - NEW, VOCAB, 48)  # every example uses a new token
X[::3, 1] = X[::3, 0]  # and some use it twice (duplicate entries in one batch)
Y = RNG.normal(size=(48, 3)).astype("float32")
NEW_ROWS = ff.Plan([ff.freeze("**/emb/**"), ff.train(f"**/emb/embeddings[{VOCAB - NEW}:]")])

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
}


def model():
    keras.utils.set_random_seed(0)
    i = keras.Input((5,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, DIM, name="emb")(i))
    return keras.Model(i, keras.layers.Dense(3, name="head")(h), name="m")


def table(m):
    return np.array(m.get_layer("emb").embeddings.numpy(), copy=True)


def fit(strategy, opt, plan=NEW_ROWS, jit=False, epochs=2, gradients="auto"):
    m = model()
    frz = ff.Freezer(m, plan, strategy=strategy, gradients=gradients)
    m.compile(optimizer=frz.wrap(opt()), loss="mse", jit_compile=jit)
    before = table(m)
    m.fit(X, Y, batch_size=12, epochs=epochs, shuffle=False, verbose=0)
    frz.verify()
    return m, frz, before


@pytest.mark.slow
@pytest.mark.parametrize("gradients", ["auto", "dense"])  # the rows' stand-in; the table's IndexedSlices taken by rows
@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compact_new_rows_train_as_restore_does_bit_for_bit(name, jit, gradients):
    m, frz, before = fit("auto", OPTIMIZERS[name], jit=jit, gradients=gradients)
    assert strategy_of(frz, "emb/embeddings") == "compact"
    r, _, _ = fit("restore", OPTIMIZERS[name], jit=jit)
    after = table(m)
    assert np.array_equal(after[: VOCAB - NEW], before[: VOCAB - NEW])  # pretrained rows: bit-identical
    assert not np.array_equal(after[VOCAB - NEW :], before[VOCAB - NEW :])
    for a, b in zip(weights_of(m), weights_of(r)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_rows_held_dense_after_a_recurring_change_train_as_restore_does_bit_for_bit(name):
    """Rows whose slice moved under ``often=True`` take the table's IndexedSlices, found by rows (``take_sparse``)."""
    moved = ff.Plan([ff.freeze("**/emb/**"), ff.train(f"**/emb/embeddings[{VOCAB - NEW - 2}:]")])

    def run(strategy):
        m = model()
        frz = ff.Freezer(m, NEW_ROWS, strategy=strategy)
        m.compile(optimizer=frz.wrap(OPTIMIZERS[name]()), loss="mse")
        m.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        frz.update(moved, often=True)
        m.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        return m, frz

    m, frz = run("auto")
    assert strategy_of(frz, "emb/embeddings") == "compact" and frz._held_dense == ["emb/embeddings"]
    r, _ = run("restore")
    for a, b in zip(weights_of(m), weights_of(r)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path


def test_new_rows_train_as_plain_keras_trains_them_with_the_other_rows_gradient_zero():
    """The reference: plain Keras on the same problem, the table's sparse gradient zero on the pretrained rows."""
    m = model()
    frz = ff.Freezer(m, NEW_ROWS)
    opt = frz.wrap(keras.optimizers.Adam(0.01))
    ref = model()
    ref_vars = [ref.get_layer("emb").embeddings, *weights_of(ref.get_layer("head"))]
    ref_opt = keras.optimizers.Adam(0.01)
    loss = keras.losses.MeanSquaredError()

    step = freezer_step(m, frz, opt)

    @tf.function
    def ref_step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, ref(x, training=True))
        grads = tape.gradient(value, ref_vars)
        g = grads[0]
        keep = tf.cast(g.indices >= VOCAB - NEW, g.values.dtype)[:, None]
        grads[0] = tf.IndexedSlices(g.values * keep, g.indices, g.dense_shape)
        ref_opt.apply_gradients(zip(grads, ref_vars))

    for _ in range(2):
        for s in range(0, len(X), 12):
            step(X[s : s + 12], Y[s : s + 12])
            ref_step(X[s : s + 12], Y[s : s + 12])
    assert strategy_of(frz, "emb/embeddings") == "compact"
    for a, b in zip(weights_of(m), weights_of(ref)):
        assert np.array_equal(a.numpy(), b.numpy()), a.path


def freezer_step(m, frz, opt):
    """A custom ``tf.function`` step on the Freezer's variables with its wrapped optimizer (MSE)."""
    loss = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, m(x, training=True))
        opt.apply_gradients(zip(tape.gradient(value, frz.trainable_variables), frz.trainable_variables))

    return step


def _outputs(graph):
    """Element counts of every tensor an op of ``graph`` (and of the functions it calls) produces."""
    sizes = []
    for op in graph.get_operations():
        for t in op.outputs:
            shape = t.shape
            if shape.rank is not None and shape.is_fully_defined():
                sizes.append((op.type, int(np.prod(shape.as_list()))))
    for f in graph._functions.values():
        sizes += _outputs(f.graph) if hasattr(f, "graph") else []
    return sizes


@pytest.mark.parametrize("strategy", ["compact", "restore"])
def test_the_gradient_of_the_whole_table_is_never_materialised(strategy):
    """No op of compact's step makes a tensor the size of the table; restore's does (the test can fail)."""
    m = model()
    frz = ff.Freezer(m, NEW_ROWS, strategy=strategy)
    opt = frz.wrap(keras.optimizers.Adam(0.01))
    opt.build(frz.trainable_variables)

    step = freezer_step(m, frz, opt)

    graph = step.get_concrete_function(tf.constant(X[:12]), tf.constant(Y[:12])).graph
    # the forward pass reads the table (ReadVariableOp, no copy, plain Keras too; StopGradient shares that
    # buffer); nothing else may be its size
    aliases = ("VarHandleOp", "ReadVariableOp", "StopGradient")
    whole = [t for t, n in _outputs(graph) if n == VOCAB * DIM and t not in aliases]
    if strategy == "compact":
        assert whole == [], whole
        state = sum(int(np.prod(v.shape)) for v in opt.variables if "emb" in v.path or "embeddings" in v.path)
        assert state <= 0.05 * 2 * VOCAB * DIM  # index, vector and Adam's two moments of the new rows only
    else:
        assert whole, "restore densifies the table's gradient (the contrast this test relies on)"


def test_element_masks_and_a_changed_set_of_rows_stay_exact():
    """A mask= that is not whole rows, then update() to other rows: compact equals restore bit for bit."""
    mask = np.random.default_rng(3).random((VOCAB, DIM)) < 0.03
    first = ff.Plan([ff.freeze("**/emb/**"), ff.train("**/emb/embeddings", mask=mask)])
    second = ff.Plan([ff.freeze("**/emb/**"), ff.train(f"**/emb/embeddings[{VOCAB - 2 * NEW}:]")])
    got = []
    for strategy in ("compact", "restore"):
        m, frz, before = fit(strategy, OPTIMIZERS["adam"], plan=first, epochs=1)
        assert np.array_equal(table(m)[~mask], before[~mask])
        frz.update(second)
        mid = table(m)
        m.fit(X, Y, batch_size=12, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        assert np.array_equal(table(m)[: VOCAB - 2 * NEW], mid[: VOCAB - 2 * NEW])
        got.append([w.numpy() for w in weights_of(m)])
    for a, b in zip(*got):
        assert np.array_equal(a, b)


def _mirrored_fit(**freezer_kw):
    """The model's weights after two epochs of fit under MirroredStrategy, the old rows checked bit for bit."""
    from test_distribute import mirrored

    with mirrored().scope():
        m = model()
        frz = ff.Freezer(m, NEW_ROWS, **freezer_kw)
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    before = table(m)
    m.fit(X, Y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    frz.verify()
    assert np.array_equal(table(m)[: VOCAB - NEW], before[: VOCAB - NEW])
    return [w.numpy() for w in weights_of(m)]


@pytest.mark.slow
def test_under_mirrored_strategy_sliced_rows_train_as_the_dense_path():
    """A block of whole rows under MirroredStrategy: read by rows and scattered by rows on every replica."""
    sliced, dense = _mirrored_fit(gradients="sliced"), _mirrored_fit(gradients="dense")
    for a, b in zip(sliced, dense):
        assert float(np.abs(a - b).max()) <= 2e-5 * float(np.abs(b).max())


@pytest.mark.slow
def test_under_mirrored_strategy_compact_equals_restore():
    for a, b in zip(_mirrored_fit(strategy="compact"), _mirrored_fit(strategy="restore")):
        assert np.array_equal(a, b)
