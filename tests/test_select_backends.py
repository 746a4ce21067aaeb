"""ff.select's data scores and ff.callbacks.Reselect on every Keras backend, against numpy's closed form.

The model is a small tanh MLP with a mean squared error loss, whose
per-example gradients numpy writes down by hand (float64). Its weights and
data come from numpy's generator, so every backend scores the same problem
and must choose the same elements: the budgets are set where the reference
top-k is well separated (asserted), and the chosen masks must equal numpy's.
"""

import os
import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import attention_model, gradients, weights_of
from finefreeze._select.scores import stream_scores
from finefreeze._select.select import split_budget

BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parent.parent
#: the small models here choose a handful of elements by count, which select warns about (a count of 1 to 100
#: looks like a percent); tests/test_select_budget.py tests the warning itself
pytestmark = pytest.mark.filterwarnings("ignore:select. budget=.* is a count:finefreeze.FreezeWarning")
UNITS, INPUTS, OUTPUTS = 8, 5, 3
PATHS = ["net/hidden/kernel", "net/hidden/bias", "net/head/kernel", "net/head/bias"]


def net(seed=7):
    m = keras.Sequential(
        [
            keras.Input((INPUTS,)),
            keras.layers.Dense(UNITS, activation="tanh", name="hidden"),
            keras.layers.Dense(OUTPUTS, name="head"),
        ],
        name="net",
    )
    rng = np.random.default_rng(seed)
    m.set_weights([rng.normal(scale=0.8, size=w.shape).astype("float32") for w in m.get_weights()])
    return m


def data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, INPUTS)).astype("float32"), rng.normal(size=(n, OUTPUTS)).astype("float32")


def value(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def values(m):
    return {v.path: value(v) for v in weights_of(m)}


def per_example_grads(w, x, y):
    """d/dtheta of mean_j (p_j - y_j)^2 for each example, by hand: a list of (n, *shape) float64 arrays."""
    w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in w)
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    h = np.tanh(x @ w1 + b1)
    dp = 2 * (h @ w2 + b2 - y) / y.shape[1]
    dz = (dp @ w2.T) * (1 - h**2)
    return [x[:, :, None] * dz[:, None, :], dz, h[:, :, None] * dp[:, None, :], dp]


def ref_fisher(w, x, y):
    return [(g**2).sum(0) for g in per_example_grads(w, x, y)]


def ref_gradient(w, x, y, batch_size):
    out = [np.zeros(np.shape(a)) for a in w]
    for s in range(0, len(y), batch_size):
        for o, g in zip(out, per_example_grads(w, x[s : s + batch_size], y[s : s + batch_size])):
            o += np.abs(g.mean(0))
    return out


def ref_delta(w, x, y, batch_size, epochs, lr):
    """|theta - theta_0| after plain SGD on the batch-mean loss."""
    cur = [np.asarray(a, np.float64).copy() for a in w]
    for _ in range(epochs):
        for s in range(0, len(y), batch_size):
            for c, g in zip(cur, per_example_grads(cur, x[s : s + batch_size], y[s : s + batch_size])):
                c -= lr * g.mean(0)
    return [np.abs(c - a) for c, a in zip(cur, w)]


def ref_top_k(scores, k, allowed=None):
    """Masks of the k largest scores over all variables in order, ties to the lower index; the gap is asserted."""
    allowed = allowed or [np.ones(np.shape(s), bool) for s in scores]
    flat = np.concatenate([np.where(a, s, -np.inf).ravel() for s, a in zip(scores, allowed)])
    order = np.lexsort((np.arange(flat.size), -flat))
    assert flat[order[k - 1]] - flat[order[k]] > 1e-3 * flat[order[0]], "the reference top-k is not well separated"
    chosen = np.zeros(flat.size, bool)
    chosen[order[:k]] = True
    out, at = [], 0
    for s in scores:
        out.append(chosen[at : at + np.size(s)].reshape(np.shape(s)))
        at += np.size(s)
    return out


def chosen(m, plan):
    frz = ff.Freezer(m, plan)
    return [~frz.frozen_mask(p) for p in PATHS]


def same(got, want):
    for p, a, b in zip(PATHS, got, want):
        assert np.array_equal(a, b), p


def scores(m, data_, **kw):
    """The raw score arrays ``select`` ranks."""
    args = dict(loss="mse", batch_size=16, limit=None, microbatch=16, epochs=1, optimizer=None, verbose=0)
    args.update(kw)
    return stream_scores(m, m.trainable_variables, data_, **args)


@pytest.mark.slow
@pytest.mark.parametrize("microbatch, per_example", [(1, "vectorized"), (7, "vectorized"), (64, "auto"), (7, "loop")])
def test_fisher_is_numpy_summed_squared_per_example_gradients(microbatch, per_example):
    m = net()
    x, y = data()
    ref = ref_fisher(m.get_weights(), x, y)
    got = scores(m, (x, y), score="fisher", microbatch=microbatch, per_example=per_example)
    for p, a, b in zip(PATHS, got, ref):
        assert a.dtype == np.float32 and a.shape == b.shape, p
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=p)
    plan = ff.select(
        m,
        (x, y),
        budget=9,
        score="fisher",
        loss="mse",
        options={"microbatch": microbatch, "per_example": per_example, "verbose": 0},
    )
    same(chosen(m, plan), ref_top_k(ref, 9))


@pytest.mark.slow
def test_gradient_is_numpy_summed_absolute_batch_gradients_from_an_iterable():
    m = net()
    x, y = data()
    ref = ref_gradient(m.get_weights(), x, y, 16)  # batches of 16, 16 and 8
    for a, b, p in zip(scores(m, (x, y), score="gradient"), ref, PATHS):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=p)
    m.compile(loss="mse")  # the compiled loss is the default
    batches = [(x[s : s + 16], y[s : s + 16]) for s in range(0, 40, 16)]
    same(chosen(m, ff.select(m, batches, budget=12, score="gradient", options={"verbose": 0})), ref_top_k(ref, 12))


def test_delta_is_numpy_sgd_and_the_model_is_put_back_bit_exactly():
    m = net()
    x, y = data()
    before = values(m)
    ref = ref_delta(m.get_weights(), x, y, 10, 2, 0.1)
    got = scores(m, (x, y), score="delta", batch_size=10, epochs=2, optimizer=keras.optimizers.SGD(0.1))
    for a, b, p in zip(got, ref, PATHS):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=p)
    plan = ff.select(
        m,
        (x, y),
        budget=0.15,
        score="delta",
        loss="mse",
        batch_size=10,
        options={"epochs": 2, "optimizer": keras.optimizers.SGD(0.1), "verbose": 0},
    )
    after = values(m)
    for p in before:
        assert np.array_equal(before[p], after[p]), p
    k = int(np.floor(0.15 * m.count_params() + 0.5))
    same(chosen(m, plan), ref_top_k(ref, k))


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1, 9, 0.2, 1.0])
@pytest.mark.parametrize("per_variable", [False, True])
def test_budgets_are_exact(budget, per_variable):
    m = net()
    x, y = data()
    n = m.count_params()
    want = budget if isinstance(budget, int) else int(np.floor(budget * n + 0.5))
    plan = ff.select(
        m,
        (x, y),
        budget=budget,
        score="fisher",
        loss="mse",
        spread="variable" if per_variable else "model",
        options={"verbose": 0},
    )
    got = chosen(m, plan)
    assert sum(int(c.sum()) for c in got) == want
    if per_variable:
        quotas = split_budget(want, [int(np.prod(v.shape)) for v in weights_of(m)])
        assert [int(c.sum()) for c in got] == quotas


def test_include_and_exclude_follow_the_numpy_scores():
    m = net()
    x, y = data()
    plan = ff.select(
        m,
        (x, y),
        budget=6,
        score="fisher",
        loss="mse",
        include="**/head/bias",
        exclude="**/hidden/bias",
        options={"verbose": 0},
    )
    got = chosen(m, plan)
    assert got[3].all() and not got[1].any()
    ref = ref_fisher(m.get_weights(), x, y)
    allowed = [np.ones(np.shape(s), bool) for s in ref]
    allowed[1][:], allowed[3][:] = False, False
    want = ref_top_k(ref, 6, allowed)
    for i in (0, 2):
        assert np.array_equal(got[i], want[i]), PATHS[i]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_the_selected_plan_trains_in_fit_and_frozen_elements_stay_bit_identical(strategy):
    m = net()
    x, y = data()
    frz = ff.Freezer(
        m, ff.select(m, (x, y), budget=0.2, score="fisher", loss="mse", options={"verbose": 0}), strategy=strategy
    )
    before = values(m)
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    frz.verify()
    after = values(m)
    for p in PATHS:
        fm = frz.frozen_mask(p)
        assert np.array_equal(before[p][fm], after[p][fm]), p
        assert (before[p][~fm] != after[p][~fm]).all(), p  # every chosen element trained
    assert frz.report()["totals"]["trainable_elements"] == int(np.floor(0.2 * m.count_params() + 0.5))


class Checker(keras.callbacks.Callback):
    """Before each step: values and frozen masks; after it: frozen elements bit-identical."""

    def __init__(self, frz):
        super().__init__()
        self.frz, self.masks, self.values = frz, [], []

    def _sync(self):  # JAX's fit keeps the state outside the variables during an epoch
        getattr(self.model, "jax_state_sync", lambda: None)()

    def on_train_batch_begin(self, batch, logs=None):
        self._sync()
        self.values.append(values(self.model))
        self.masks.append({p: self.frz.frozen_mask(p) for p in PATHS})

    def on_train_batch_end(self, batch, logs=None):
        self._sync()
        now = values(self.model)
        for p, fm in self.masks[-1].items():
            assert np.array_equal(self.values[-1][p][fm], now[p][fm]), p


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_reselect_inside_fit_swaps_least_moved_for_largest_gradient_and_keeps_frozen_elements_exact(strategy):
    m = net()
    x, y = data(48)
    plan = ff.select(m, (x, y), budget=0.25, score="fisher", loss="mse", options={"verbose": 0})
    frz = ff.Freezer(m, plan, strategy=strategy)
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.05)), loss="mse")
    start = values(m)
    checker = Checker(frz)
    cb = ff.callbacks.Reselect((x, y), every=3, fraction=0.3, batches=2, batch_size=16)
    m.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb, checker]
    )  # Reselect first: on JAX it must sync itself
    frz.verify()
    assert [s["step"] for s in cb.swaps] == [3, 6, 9, 12]
    assert len({h["trainable_elements"] for h in frz.history}) == 1  # each variable keeps its count
    assert not any(h["retraced"] for h in frz.history)
    masks = checker.masks
    assert any(not np.array_equal(masks[0][p], masks[-1][p]) for p in PATHS)  # the trained set changed
    end = values(m)
    for p in PATHS:  # never trained at all: bit-identical to the start
        never = np.logical_and.reduce([mk[p] for mk in masks])
        assert np.array_equal(start[p][never], end[p][never]), p
    # the first swap, after step 3, against numpy: values it saw are those before step 4
    seen = [checker.values[3][p] for p in PATHS]
    g = ref_gradient(seen, x[:32], y[:32], 16)  # batches=2 of batch_size=16
    swap = cb.swaps[0]["swapped"]
    assert swap
    for i, p in enumerate(PATHS):
        tr_b, tr_a = ~masks[2][p], ~masks[3][p]
        if p not in swap:
            assert np.array_equal(tr_b, tr_a), p
            continue
        d = swap[p]
        assert d == int(np.floor(0.3 * tr_b.sum() + 0.5))
        moved = np.abs(seen[i].astype(np.float64) - start[p]).ravel()
        cand = np.flatnonzero(tr_b.ravel())
        drop = cand[np.lexsort((cand, moved[cand]))]
        frozen = np.flatnonzero(~tr_b.ravel())
        grow = frozen[np.lexsort((frozen, -g[i].ravel()[frozen]))]
        gi = g[i].ravel()
        assert d == len(drop) or moved[drop[d]] - moved[drop[d - 1]] > 1e-7  # no near-tie at the cut
        assert d == len(grow) or gi[grow[d - 1]] > gi[grow[d]] * 1.001
        want = tr_b.ravel().copy()
        want[drop[:d]] = False
        want[grow[:d]] = True
        assert np.array_equal(tr_a.ravel(), want), p


def test_fisher_on_attention_matches_a_loop_of_single_example_gradients():
    m = attention_model()
    rng = np.random.default_rng(1)
    m.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in m.get_weights()])
    x, y = rng.normal(size=(6, 6, 4)).astype("float32"), rng.integers(0, 4, 6).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = [np.zeros(v.shape) for v in m.trainable_variables]
    for i in range(len(y)):  # the backend's own gradient (tape, jax.grad, backward) of one example at a time
        g = gradients(lambda i=i: loss(y[i : i + 1], m(x[i : i + 1])), m.trainable_variables)
        for r, gi in zip(ref, g):
            r += np.asarray(keras.ops.convert_to_numpy(gi), np.float64) ** 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing on stderr (PyTorch's vmap warns about its slow attention rule)
        got = scores(m, (x, y), score="fisher", loss=loss, microbatch=3)
    for v, a, b in zip(m.trainable_variables, got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=v.path)


def test_bad_input_is_a_plan_error_and_changes_nothing():
    m = net()
    x, y = data()
    before = values(m)
    with pytest.raises(ff.PlanError, match="per_example"):
        ff.select(m, (x, y), budget=3, loss="mse", options={"per_example": "pfor"})
    with pytest.raises(ff.PlanError, match="needs data"):
        ff.select(m, budget=3, score="gradient", loss="mse")
    with pytest.raises(ff.PlanError, match="not compiled with a loss"):
        ff.select(m, (x, y), budget=3, score="delta", options={"verbose": 0})
    with pytest.raises(ff.PlanError, match="different numbers of examples"):
        ff.select(m, (x, y[:5]), budget=3, loss="mse", options={"verbose": 0})
    with pytest.raises(ff.PlanError, match="no batches"):
        ff.select(m, [], budget=3, score="gradient", loss="mse", options={"verbose": 0})
    with pytest.raises(ff.PlanError, match=r"data is a dict \(keys \['x'\]\); pass data=\(x, y\)"):
        ff.select(m, {"x": x}, budget=3, loss="mse", options={"verbose": 0})
    with pytest.raises(ff.PlanError, match="the data does not fit the model"):
        ff.select(m, (np.ones((8, 3), "float32"), y[:8]), budget=3, loss="mse", options={"verbose": 0})
    after = values(m)
    assert all(np.array_equal(before[p], after[p]) for p in before)
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD()), loss="mse")
    with pytest.raises(ff.PlanError, match="no partially frozen variable"):
        m.fit(x, y, verbose=0, callbacks=[ff.callbacks.Reselect((x, y), every=2)])
    after = values(m)
    assert all(np.array_equal(before[p], after[p]) for p in before)


CHILD = """
import sys
import keras, numpy as np
import finefreeze as ff
m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")], name="m")
rng = np.random.default_rng(0)
x, y = rng.normal(size=(32, 5)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
for score in ("fisher", "gradient", "delta"):
    plan = ff.select(m, (x, y), budget=0.1, score=score, loss="mse", options={"verbose": 0})
    print(score, ff.Freezer(m, plan).report()["totals"]["trainable_elements"])
frz = ff.Freezer(m, plan)
m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
cb = ff.callbacks.Reselect((x, y), every=2, fraction=0.5)
m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
print("reselected", len(cb.swaps))
print("tensorflow imported:", "tensorflow" in sys.modules)
"""


@pytest.mark.slow
def test_select_and_reselect_do_not_import_tensorflow_off_tensorflow():
    backend = BACKEND if BACKEND != "tensorflow" else "jax"
    env = dict(
        os.environ,
        KERAS_BACKEND=backend,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    got = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    lines = got.stdout.strip().splitlines()
    assert lines[:3] == ["fisher 3", "gradient 3", "delta 3"], lines  # 10 % of the 34 elements, rounded
    assert lines[-2:] == ["reselected 2", "tensorflow imported: False"], lines


if BACKEND == "torch":

    class ItemScale(keras.layers.Layer):
        """Reads a value in Python (``.item()``): ``torch.func.vmap`` cannot batch that."""

        def call(self, x):
            return x / (1.0 + keras.ops.max(keras.ops.abs(x)).item())

    def test_torch_auto_falls_back_to_a_loop_where_vmap_cannot_batch_and_vectorized_says_so():
        m = keras.Sequential([keras.Input((INPUTS,)), keras.layers.Dense(OUTPUTS, name="d"), ItemScale()], name="n")
        x, y = data(8)
        loop = scores(m, (x, y), score="fisher", microbatch=4, per_example="loop")
        auto = scores(m, (x, y), score="fisher", microbatch=4, per_example="auto")
        for a, b in zip(auto, loop):
            assert np.array_equal(a, b)
        ref = [np.zeros(v.shape) for v in m.trainable_variables]
        for i in range(len(y)):
            g = gradients(lambda i=i: keras.losses.mean_squared_error(y[i : i + 1], m(x[i : i + 1]))[0], weights_of(m))
            for r, gi in zip(ref, g):
                r += np.asarray(keras.ops.convert_to_numpy(gi), np.float64) ** 2
        for a, b in zip(auto, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        with pytest.raises(ff.PlanError, match="per_example='auto' or 'loop'"):
            ff.select(m, (x, y), budget=3, loss="mse", options={"per_example": "vectorized", "verbose": 0})


NUMPY_CHILD = """
import keras, numpy as np
import finefreeze as ff
m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="a")], name="m")
x, y = np.ones((4, 5), "float32"), np.ones((4, 4), "float32")
print(ff.Freezer(m, ff.select(m, budget=3, score="magnitude")).report()["totals"]["trainable_elements"])
for score in ("fisher", "gradient", "delta"):
    try:
        ff.select(m, (x, y), budget=3, score=score, loss="mse")
    except ff.PlanError as e:
        print(e)
"""


@pytest.mark.slow
def test_a_backend_that_takes_no_gradients_is_a_plan_error():
    env = dict(
        os.environ,
        KERAS_BACKEND="numpy",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    got = subprocess.run([sys.executable, "-c", NUMPY_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    lines = got.stdout.strip().splitlines()
    assert lines[0] == "3" and len(lines) == 4, lines
    for line in lines[1:]:
        assert "on the TensorFlow, JAX and PyTorch backends (the backend is 'numpy')" in line, line
        assert "score='magnitude' or 'random'" in line, line
