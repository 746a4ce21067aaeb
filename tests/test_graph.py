"""Plans on tf.compat.v1 graph code: frz.var_list and frz.minimize, exact with every tf.compat.v1.train optimizer.

Every graph is built under ``with tf.Graph().as_default()`` and run in its own
``tf.compat.v1.Session`` (eager execution stays on for the rest of the suite).
"""

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import finefreeze as ff
from backend_utils import strategy_of

pytestmark = pytest.mark.backends("tensorflow", reason="tf.compat.v1 graph code")

v1 = tf.compat.v1
T = v1.train

# One line per optimizer configuration; ``gs`` is the graph's global step (AdagradDA needs it).
OPTIMIZERS = {
    "gd": lambda gs: T.GradientDescentOptimizer(0.05),
    "momentum": lambda gs: T.MomentumOptimizer(0.05, 0.9),
    "nesterov": lambda gs: T.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "momentum_locking": lambda gs: T.MomentumOptimizer(0.05, 0.9, use_locking=True),
    "adam": lambda gs: T.AdamOptimizer(0.05),
    "adam_locking": lambda gs: T.AdamOptimizer(0.05, use_locking=True),
    "adagrad": lambda gs: T.AdagradOptimizer(0.1),
    "adagrad_da": lambda gs: T.AdagradDAOptimizer(0.1, gs, l1_regularization_strength=0.001),
    "adagrad_da_l2": lambda gs: T.AdagradDAOptimizer(0.1, gs, l2_regularization_strength=0.01),
    "adadelta": lambda gs: T.AdadeltaOptimizer(1.0),
    "rmsprop": lambda gs: T.RMSPropOptimizer(0.01),
    "rmsprop_momentum": lambda gs: T.RMSPropOptimizer(0.01, momentum=0.9),
    "rmsprop_centered": lambda gs: T.RMSPropOptimizer(0.01, momentum=0.5, centered=True),
    "ftrl": lambda gs: T.FtrlOptimizer(0.1),
    "ftrl_l1_l2": lambda gs: T.FtrlOptimizer(
        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.01
    ),
    "proximal_gd": lambda gs: T.ProximalGradientDescentOptimizer(0.05, l1_regularization_strength=0.01),
    "proximal_gd_l2": lambda gs: T.ProximalGradientDescentOptimizer(0.05, l2_regularization_strength=0.05),
    "proximal_adagrad": lambda gs: T.ProximalAdagradOptimizer(
        0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.01
    ),
}

RNG = np.random.default_rng(7)
X = RNG.normal(size=(16, 5)).astype("float32")
Y = RNG.normal(size=(16, 3)).astype("float32")
W0 = RNG.normal(size=(5, 3)).astype("float32")
B0 = RNG.normal(size=(3,)).astype("float32")
C0 = RNG.normal(size=(3,)).astype("float32")
FROZEN_W = RNG.random((5, 3)) < 0.5  # element mask of net/w
WARM, STEPS = 3, 6


def _net(w, b, c):
    return tf.reduce_mean(tf.square(tf.tanh(X @ w + b) * c - Y))


def _variables():
    return [v1.get_variable(n, initializer=x) for n, x in (("net/w", W0), ("net/b", B0), ("net/c", C0))]


def _ours(name):
    """Warm phase with the plain optimizer, then the same optimizer through frz.minimize."""
    with tf.Graph().as_default() as g:
        gs = T.get_or_create_global_step()
        w, b, c = _variables()
        loss = _net(w, b, c)
        opt = OPTIMIZERS[name](gs)
        warm = opt.minimize(loss, global_step=gs)
        frz = ff.tf1.Freezer(g, ff.Plan([ff.freeze("net/c"), ff.freeze("net/w", mask=FROZEN_W)]))
        op = frz.minimize(opt, loss, global_step=gs)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(WARM):
                sess.run(warm)
            frz.activate(sess)
            at_freeze = sess.run([w, b, c])
            for _ in range(STEPS):
                sess.run(op)
            frz.verify()
            return frz, at_freeze, sess.run([w, b, c, gs])


def _reference(name):
    """The same problem by hand: the loss sees the frozen elements as a snapshot; var_list leaves out net/c."""
    with tf.Graph().as_default() as g:
        gs = T.get_or_create_global_step()
        w, b, c = _variables()
        snap = v1.Variable(np.zeros_like(W0), trainable=False, name="snap")
        opt = OPTIMIZERS[name](gs)
        warm = opt.minimize(_net(w, b, c), global_step=gs)
        frozen_loss = _net(tf.where(FROZEN_W, snap, w), b, c)
        op = opt.minimize(frozen_loss, var_list=[w, b], global_step=gs)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(WARM):
                sess.run(warm)
            sess.run(snap.assign(w))
            for _ in range(STEPS):
                sess.run(op)
            return sess.run([w, b])


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_v1_optimizer_is_exact_after_a_warm_phase(name):
    frz, (w1, b1, c1), (w2, b2, c2, step) = _ours(name)
    wr, br = _reference(name)
    assert np.array_equal(w2[FROZEN_W], w1[FROZEN_W]) and np.array_equal(c2, c1)  # frozen: bit-identical
    assert np.array_equal(w2[~FROZEN_W], wr[~FROZEN_W]) and np.array_equal(b2, br)  # trainable: as by hand
    assert not np.array_equal(w2[~FROZEN_W], w1[~FROZEN_W])  # and the frozen phase did train
    assert step == WARM + STEPS
    assert [v.name for v in frz.var_list] == ["net/w:0", "net/b:0"]


@pytest.mark.parametrize("name", ["momentum", "adam", "rmsprop_momentum", "ftrl"])
def test_reference_variables_are_exact_too(name):
    """A reference (non-resource) variable is updated in place: its snapshot must be a copy."""
    with tf.Graph().as_default() as g:
        gs = T.get_or_create_global_step()
        w = v1.Variable(W0, name="w", use_resource=False)
        loss = tf.reduce_mean(tf.square(tf.tanh(X @ w) - Y))
        opt = OPTIMIZERS[name](gs)
        warm = opt.minimize(loss)
        frz = ff.tf1.Freezer(g, [ff.freeze("w", mask=FROZEN_W)])
        op = frz.minimize(opt, loss)
        assert type(w).__name__ == "RefVariable"
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(WARM):
                sess.run(warm)
            frz.activate(sess)
            before = sess.run(w)
            for _ in range(STEPS):
                sess.run(op)
            after = sess.run(w)
            frz.verify()
    assert np.array_equal(after[FROZEN_W], before[FROZEN_W])
    assert not np.array_equal(after[~FROZEN_W], before[~FROZEN_W])


def _sqrt_run(x0, freeze_middle: bool):
    with tf.Graph().as_default() as g:
        x = v1.get_variable("x", initializer=x0)
        loss = tf.reduce_sum(tf.sqrt(x))  # sqrt(-1): NaN loss and a NaN gradient at x[1] only
        opt = T.AdamOptimizer(0.1)
        if freeze_middle:
            frz = ff.tf1.Freezer(g, [ff.freeze("x[1]")])
            op = frz.minimize(opt, loss)
        else:
            op = opt.minimize(loss)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(op)
            return sess.run([x, opt.get_slot(x, "m"), opt.get_slot(x, "v")])


def test_a_nan_gradient_on_a_frozen_element_is_selected_away_not_multiplied():
    x, m, v = _sqrt_run(np.array([4.0, -1.0, 9.0], "float32"), freeze_middle=True)
    ref, _, _ = _sqrt_run(np.array([4.0, 9.0], "float32"), freeze_middle=False)  # the trainable part alone
    assert np.isfinite(m).all() and np.isfinite(v).all()  # NaN * 0 would be NaN in Adam's moments
    assert np.array_equal(x[1:2], np.array([-1.0], "float32"))
    assert np.array_equal(x[[0, 2]], ref)


VOCAB, DIM = 12, 4
E0 = RNG.normal(size=(VOCAB, DIM)).astype("float32")
IDS = np.array([[1, 3, 10], [10, 11, 3], [0, 11, 11]])  # repeated ids: duplicate slices
FROZEN_ROWS = np.arange(VOCAB) < 10  # pretrained rows 0..9 frozen; the new rows 10, 11 train


def _embedding_run(name, by_hand):
    with tf.Graph().as_default() as g:
        gs = T.get_or_create_global_step()
        emb = v1.get_variable("emb", initializer=E0)
        loss = tf.reduce_sum(tf.square(tf.reduce_sum(tf.nn.embedding_lookup(emb, IDS), axis=1) - 1.0))
        opt = OPTIMIZERS[name](gs)
        warm = opt.minimize(loss)
        if by_hand:  # the exact TF1 recipe written out: select slices, apply, scatter the frozen rows back
            snap = v1.Variable(np.zeros_like(E0), trainable=False)
            [(grad, _)] = opt.compute_gradients(loss, var_list=[emb])
            assert isinstance(grad, tf.IndexedSlices)
            keep = ~tf.gather(tf.constant(FROZEN_ROWS), grad.indices)[:, None]
            grad = tf.IndexedSlices(grad.values * tf.cast(keep, tf.float32), grad.indices, grad.dense_shape)
            with tf.control_dependencies([opt.apply_gradients([(grad, emb)])]):
                rows = np.flatnonzero(FROZEN_ROWS)
                op = v1.scatter_update(emb, rows, tf.gather(snap, rows))
        else:
            frz = ff.tf1.Freezer(g, [ff.freeze("emb[:10]")])
            op = frz.minimize(opt, loss)
        types = {o.type for o in g.get_operations()}
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(WARM):
                sess.run(warm)
            if by_hand:
                sess.run(snap.assign(emb))
            else:
                frz.activate(sess)
            before = sess.run(emb)
            for _ in range(STEPS):
                sess.run(op)
            if not by_hand:
                frz.verify()
            return before, sess.run(emb), types


@pytest.mark.parametrize("name", ["adagrad", "adam", "momentum", "ftrl", "rmsprop_momentum"])
def test_sparse_embedding_gradients_stay_sparse_and_exact(name):
    before, after, types = _embedding_run(name, by_hand=False)
    _, ref, _ = _embedding_run(name, by_hand=True)
    assert any("Sparse" in t or "Scatter" in t for t in types)  # the optimizer's sparse path
    assert np.array_equal(after[FROZEN_ROWS], before[FROZEN_ROWS])
    assert np.array_equal(after[~FROZEN_ROWS], ref[~FROZEN_ROWS])
    assert not np.array_equal(after[~FROZEN_ROWS], before[~FROZEN_ROWS])


def _two_ops(ours: bool, partial: bool = False):
    """The 'freeze a in one op, b in another' pattern, each op with its own Adam."""
    with tf.Graph().as_default() as g:
        a = v1.get_variable("a", initializer=W0)
        b = v1.get_variable("b", initializer=W0.T.copy())
        loss = tf.reduce_mean(tf.square(tf.tanh(X @ a) @ b - X))
        opt_a, opt_b = T.AdamOptimizer(0.05, name="adam_a"), T.AdamOptimizer(0.02, name="adam_b")
        if ours:
            pick = ff.train("b", indices=[(0, 0), (2, 1)]) if partial else None
            frz_a = ff.tf1.Freezer(g, [ff.freeze("a")] + ([ff.freeze("b"), pick] if partial else []))
            frz_b = ff.tf1.Freezer(g, [ff.freeze("b")])
            op_a, op_b = frz_a.minimize(opt_a, loss), frz_b.minimize(opt_b, loss)
        else:
            op_a, op_b = opt_a.minimize(loss, var_list=[b]), opt_b.minimize(loss, var_list=[a])
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            steps = []
            for i in range(8):
                before = sess.run([a, b])
                sess.run(op_a if i % 3 else op_b)
                steps.append((i % 3 != 0, before, sess.run([a, b])))
            slots = {
                opt.get_slot(v, "m").name for opt in (opt_a, opt_b) for v in (a, b) if opt.get_slot(v, "m") is not None
            }
            return steps, slots


def test_two_train_ops_match_the_hand_written_var_list_recipe_bitwise():
    ours, slots = _two_ops(ours=True)
    ref, ref_slots = _two_ops(ours=False)
    assert slots == ref_slots == {"b/adam_a:0", "a/adam_b:0"}  # one Adam each, slots only for what it trains
    for (_, _, got), (_, _, want) in zip(ours, ref):
        assert all(np.array_equal(x, y) for x, y in zip(got, want))


def test_two_train_ops_with_element_plans_keep_each_ops_frozen_elements():
    steps, _ = _two_ops(ours=True, partial=True)
    keep = np.ones((3, 5), bool)
    keep[0, 0] = keep[2, 1] = False
    for is_a, (a0, b0), (a1, b1) in steps:
        if is_a:  # op_a trains only b[0,0] and b[2,1]
            assert np.array_equal(a1, a0) and np.array_equal(b1[keep], b0[keep]) and not np.array_equal(b1, b0)
        else:  # op_b trains a only
            assert np.array_equal(b1, b0) and not np.array_equal(a1, a0)


def _graph():
    g = tf.Graph()
    with g.as_default():
        v1.get_variable("enc/w", initializer=W0)
        v1.get_variable("head/w", initializer=B0)
        v1.Variable(0.0, trainable=False, name="counter")
    return g


def test_var_list_summary_masks_plot_and_where_through_a_session(tmp_path):
    g = _graph()
    enc, head = g.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
    with v1.Session(graph=g) as sess:
        sess.run(v1.global_variables_initializer())
        frz = ff.tf1.Freezer(g, [ff.freeze("enc/w", where=lambda w: w > 0), ff.freeze(head)], session=sess)
    assert type(frz) is ff.tf1.Freezer
    assert frz.var_list == [enc]
    assert np.array_equal(frz.frozen_mask("enc/w"), W0 > 0)
    assert frz.variable_state("head/w") == "frozen" and strategy_of(frz, "enc/w") == "restore"
    text = frz.summary()
    assert "enc/w" in text and "partial" in text and "counter" not in text  # only TRAINABLE_VARIABLES
    assert "1: freeze('enc/w', where=<lambda>)" in text  # the numbered plan
    assert "graph, 1" in text and "keras" not in text.lower()  # decided by: the graph's state, then rule 1
    totals = frz.report()["totals"]
    assert totals["frozen_elements"] == int((W0 > 0).sum()) + 3
    assert totals["trainable_elements"] == int((W0 <= 0).sum())
    assert (
        frz.plot(tmp_path / "frozen.png") == str(tmp_path / "frozen.png") and (tmp_path / "frozen.png").stat().st_size
    )
    assert type(ff.Freezer([tf.Variable(W0, name="eager")], [ff.freeze("eager[0]")])) is ff.Freezer  # eager variables
    for graph_target in (g, [enc], enc):
        with pytest.raises(ff.PlanError, match=r"graph variables: use ff\.tf1\.Freezer\(target, plan\)"):
            ff.Freezer(graph_target, [ff.freeze("enc/w[0]")])


class _Linear(tf.Module):
    def __init__(self):
        super().__init__(name="linear")
        self.w = tf.Variable(W0, name="w")
        self.b = tf.Variable(B0, name="b")


def test_a_tf_module_built_in_a_graph_is_a_graph_target():
    with tf.Graph().as_default() as g:
        m = _Linear()
        loss = tf.reduce_sum(tf.square(X @ m.w + m.b))
        frz = ff.tf1.Freezer(m, [ff.freeze("w[0]")])
        op = frz.minimize(T.MomentumOptimizer(0.1, 0.9), loss)
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            frz.activate()
            for _ in range(3):
                sess.run(op)
            frz.verify()
            w = sess.run(m.w)
    assert frz.graph is g and [v.name for v in frz.var_list] == ["b:0", "w:0"]
    assert np.array_equal(w[0], W0[0]) and not np.array_equal(w[1:], W0[1:])
    eager = _Linear()  # the same module in eager mode: ff.Freezer's
    assert type(ff.Freezer(eager, [ff.freeze("w[0]")])) is ff.Freezer


def test_verify_names_a_frozen_element_written_outside_the_train_op():
    g = _graph()
    with g.as_default():
        enc = g.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0]
        poke = enc[1, 2].assign(123.0)
        fine = enc[0, 0].assign(5.0)
    with v1.Session(graph=g) as sess:
        sess.run(v1.global_variables_initializer())
        frz = ff.tf1.Freezer([enc], [ff.freeze("enc/w[1:]")])
        frz.activate()  # the default session
        sess.run(fine)  # a trainable element: not a violation
        frz.verify()
        sess.run(poke)
        with pytest.raises(ff.FrozenValueChanged, match=r"enc/w: changed in 1 of 1 blocks") as e:
            frz.verify()
    assert e.value.violations[0][0] == "enc/w"


def _raises(fn, match):
    with pytest.raises(ff.PlanError, match=match):
        fn()


def test_bad_input_is_a_plan_error_and_adds_nothing_to_the_graph():
    g, other = _graph(), _graph()
    with g.as_default():
        enc, head = g.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
        loss = tf.reduce_sum(enc) + tf.reduce_sum(head)
        head_only = tf.reduce_sum(head * 2.0)
        step = tf.constant(1)
        init = v1.global_variables_initializer()
    with other.as_default():
        foreign_loss = tf.reduce_sum(other.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0])
    foreign = other.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0]
    frz = ff.tf1.Freezer(g, [ff.freeze("head/**")])
    n_ops, sgd = len(g.get_operations()), T.GradientDescentOptimizer(0.1)
    _raises(lambda: frz.minimize(sgd, foreign_loss), "not in the Freezer's graph.*another graph")
    _raises(lambda: frz.minimize(sgd, tf.constant(1.0)), "eager context")  # an eager tensor
    _raises(lambda: frz.minimize(sgd, 1.0), "must be a tensor of the Freezer's graph, got a float")
    _raises(lambda: frz.minimize(sgd, step), "dtype int32")
    _raises(lambda: frz.minimize(sgd, head_only), "depends on none of the 1 variables the plan trains .enc/w.")
    import keras

    with pytest.raises(TypeError, match="tf.compat.v1.train optimizer.*keras"):  # as Freezer.wrap: an optimizer kind
        frz.minimize(keras.optimizers.SGD(), loss)
    assert len(g.get_operations()) == n_ops  # nothing added
    _raises(lambda: ff.tf1.Freezer(g, [ff.freeze("enc/kernel")]), "selects nothing.*Closest existing paths: enc/w")
    _raises(lambda: ff.tf1.Freezer(g, [ff.freeze(foreign)]), "selects nothing")  # a variable of another graph
    _raises(lambda: ff.tf1.Freezer([enc, foreign], [ff.freeze("enc/w")]), "2 different graphs")
    _raises(lambda: ff.tf1.Freezer([enc, tf.Variable(1.0)], [ff.freeze("enc/w")]), "item 1 .* eager variable")
    _raises(lambda: ff.tf1.Freezer(g, [ff.freeze("**")]), "leaves nothing to train")
    _raises(lambda: ff.tf1.Freezer(g, [ff.train("enc/**", lr_scale=0.1)]), "lr_scale is not available")
    _raises(lambda: ff.tf1.Freezer(g, [ff.freeze("head/w")], strategy="compact"), "'compact' is not available")
    _raises(lambda: ff.tf1.Freezer(g, [ff.freeze("enc/w", where=lambda w: w > 0)]), "needs a session")
    _raises(lambda: ff.tf1.Freezer(tf.Graph(), [ff.freeze("a")]), "no variables in its TRAINABLE_VARIABLES")
    _raises(lambda: frz.verify(), "no fingerprint .* frz.activate")
    assert not any(hasattr(frz, n) for n in ("update", "wrap", "save_delta"))  # a train op keeps its plan
    _raises(lambda: frz.frozen_mask("head/b"), "closest: head/w")
    with v1.Session(graph=other) as wrong:
        _raises(lambda: ff.tf1.Freezer(g, [ff.freeze("head/w")], session=wrong), "another graph")
    with v1.Session(graph=g) as sess:
        early = ff.tf1.Freezer(g, [ff.freeze("head/**")])  # in a session, before the initializer: fingerprint later
        _raises(lambda: early.verify(), "no fingerprint .* frz.activate")
        _raises(lambda: frz.activate(sess), "not initialized in this session: head/w; run `sess.run")
        sess.run(init)
        early.activate().verify()
    assert len(g.get_operations()) == n_ops
    g.finalize()
    _raises(lambda: frz.minimize(sgd, loss), "graph is finalized")


def _apply_run(how):
    """Adam after a warm phase: frz.minimize, or frz.apply_gradients on pairs computed by hand."""
    with tf.Graph().as_default() as g:
        w, b, c = _variables()
        loss = _net(w, b, c)
        opt = T.AdamOptimizer(0.05)
        warm = opt.minimize(loss)
        frz = ff.tf1.Freezer(g, [ff.freeze("net/c"), ff.freeze("net/w", mask=FROZEN_W)])
        if how == "minimize":
            op = frz.minimize(opt, loss)
        elif how == "all pairs":  # pairs of every variable: the fully frozen net/c is left out
            op = frz.apply_gradients(opt, opt.compute_gradients(loss, var_list=[w, b, c]))
        else:  # clipped per tensor first
            grads = opt.compute_gradients(loss, var_list=frz.var_list)
            op = frz.apply_gradients(opt, [(tf.clip_by_norm(gr, 0.01), v) for gr, v in grads])
        with v1.Session(graph=g) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(WARM):
                sess.run(warm)
            frz.activate()
            before = sess.run([w, b, c])
            for _ in range(STEPS):
                sess.run(op)
            frz.verify()
            return before, sess.run([w, b, c])


def test_apply_gradients_matches_minimize_and_leaves_fully_frozen_pairs_out():
    _, by_minimize = _apply_run("minimize")
    _, by_pairs = _apply_run("all pairs")
    assert all(np.array_equal(x, y) for x, y in zip(by_pairs, by_minimize))
    (w0, b0, c0), (w1, b1, c1) = _apply_run("clipped")
    assert np.array_equal(w1[FROZEN_W], w0[FROZEN_W]) and np.array_equal(c1, c0)
    assert not np.array_equal(b1, b0) and not np.array_equal(b1, by_minimize[1])  # clipped: another trajectory


def test_apply_gradients_refuses_foreign_variables_and_pairs_without_gradients():
    g, other = _graph(), _graph()
    with g.as_default():
        enc, head = g.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)
        grad, head_grad = tf.ones_like(enc), tf.ones_like(head)
    foreign = other.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES)[0]
    frz, sgd = ff.tf1.Freezer(g, [ff.freeze("head/**")]), T.GradientDescentOptimizer(0.1)
    n_ops = len(g.get_operations())
    _raises(lambda: frz.apply_gradients(sgd, [(grad, foreign)]), "item 0: variable 'enc/w' is not one of this")
    _raises(lambda: frz.apply_gradients(sgd, [grad]), "item 0 is not a .gradient, variable. pair")
    _raises(lambda: frz.apply_gradients(sgd, [(head_grad, head)]), "no gradient for any variable the plan")
    _raises(lambda: frz.apply_gradients(sgd, [(None, enc)]), "no gradient for any variable the plan")
    with pytest.raises(TypeError, match="apply_gradients.. takes a tf.compat.v1.train optimizer"):
        frz.apply_gradients(object(), [(grad, enc)])
    assert len(g.get_operations()) == n_ops


def test_the_example_on_the_tf1_page_runs(capsys):
    page = (pathlib.Path(__file__).parent.parent / "docs" / "tf1.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    ns = {}
    exec(compile(code, "docs/tf1.md", "exec"), ns)  # noqa: S102
    assert ns["frz"].variable_state("encoder/w") == "partial" and ns["frz"].variable_state("head/w") == "trainable"
    assert "encoder" in capsys.readouterr().out


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    shape=st.tuples(st.integers(2, 6))
    | st.tuples(st.integers(1, 5), st.integers(2, 5))
    | st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(2, 4)),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["nesterov", "adam", "rmsprop_centered", "ftrl_l1_l2", "proximal_adagrad", "adagrad_da"]),
)
def test_any_mask_on_any_shape_is_exact_and_trains_as_by_hand(shape, seed, name):
    rng = np.random.default_rng(seed)
    x0 = rng.normal(size=shape).astype("float32")
    target = rng.normal(size=shape).astype("float32")
    frozen = rng.random(shape) < rng.random()
    frozen.flat[0], frozen.flat[-1] = True, False  # partially frozen, whatever the draw

    def run(ours):
        with tf.Graph().as_default() as g:
            gs = T.get_or_create_global_step()
            x = v1.get_variable("x", initializer=x0)
            snap = v1.Variable(np.zeros_like(x0), trainable=False, name="snap")
            opt = OPTIMIZERS[name](gs)
            warm = opt.minimize(tf.reduce_sum(tf.sin(x) * target), global_step=gs)
            if ours:
                op = ff.tf1.Freezer(g, [ff.freeze("x", mask=frozen)]).minimize(
                    opt, tf.reduce_sum(tf.sin(x) * target), global_step=gs
                )
            else:
                op = opt.minimize(tf.reduce_sum(tf.sin(tf.where(frozen, snap, x)) * target), global_step=gs)
            with v1.Session(graph=g) as sess:
                sess.run(v1.global_variables_initializer())
                for _ in range(2):
                    sess.run(warm)
                sess.run(snap.assign(x))
                before = sess.run(x)
                for _ in range(3):
                    sess.run(op)
                return before, sess.run(x)

    before, after = run(ours=True)
    _, ref = run(ours=False)
    assert np.array_equal(after[frozen], before[frozen])
    assert np.array_equal(after[~frozen], ref[~frozen])


def test_a_graph_freezer_takes_the_gradients_setting_of_every_freezer_and_refuses_slices():
    with tf.Graph().as_default() as g:
        v1.get_variable("x", initializer=np.zeros(3, np.float32))
        for given in ("auto", "dense"):
            assert ff.tf1.Freezer(g, [ff.freeze("x[1]")], gradients=given)._gradients == "dense"
        with pytest.raises(ff.PlanError, match="gradients='sliced' is not available for tf.compat.v1 graphs"):
            ff.tf1.Freezer(g, [ff.freeze("x[1]")], gradients="sliced")
