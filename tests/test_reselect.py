"""ff.callbacks.Reselect: drop and regrow through element-level update(), exact throughout.

A TensorFlow-suite module; its references take gradients with the backend's
own autodiff (``backend_utils.gradients``), so it also runs under another
``KERAS_BACKEND`` when named on the command line.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import gradients, weights_of
from conftest import mlp

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 4, n).astype("int32")


class Checker(keras.callbacks.Callback):
    """Before each step: record values and frozen masks; after it: frozen elements are bit-identical."""

    def __init__(self, frz):
        super().__init__()
        self.frz, self.masks, self.values, self.checked = frz, [], [], 0

    def on_train_batch_begin(self, batch, logs=None):
        self.before = {v.path: np.array(v.numpy(), copy=True) for v in weights_of(self.model)}
        self.values.append(self.before)
        self.masks.append({p: self.frz.frozen_mask(p) for p in self.before})

    def on_train_batch_end(self, batch, logs=None):
        for v in weights_of(self.model):
            fm = self.masks[-1][v.path]
            assert np.array_equal(self.before[v.path][fm], v.numpy()[fm]), v.path
            self.checked += int(fm.sum())


def run(strategy, optimizer, epochs=4):
    m = mlp(units=(16, 16, 4))
    x, y = data()
    plan = ff.select(m, (x, y), budget=0.1, score="fisher", loss=LOSS, include="**/head/**", options={"verbose": 0})
    frz = ff.Freezer(m, plan, strategy=strategy)
    m.compile(optimizer=frz.wrap(optimizer), loss=LOSS)
    start = [np.array(v.numpy(), copy=True) for v in weights_of(m)]
    checker = Checker(frz)
    cb = ff.callbacks.Reselect((x, y), every=3, fraction=0.3, batches=2, batch_size=16)
    m.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[checker, cb])
    return m, frz, cb, checker, start, (x, y)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_reselection_swaps_elements_and_frozen_elements_never_move(strategy):
    m, frz, cb, checker, start, _ = run(strategy, keras.optimizers.AdamW(1e-2, weight_decay=0.1))
    frz.verify()
    assert len(cb.swaps) == 8 and all(s["swapped"] for s in cb.swaps)  # 24 steps, every 3
    assert checker.checked > 0
    counts = {h["trainable_elements"] for h in frz.history}
    assert len(counts) == 1  # each variable keeps its number of trained elements
    masks = checker.masks
    assert any(not np.array_equal(masks[0][p], masks[-1][p]) for p in masks[0])
    for v, s in zip(weights_of(m), start):  # never trained at all: bit-identical to the start
        never = np.logical_and.reduce([mk[v.path] for mk in masks])
        assert np.array_equal(s[never], v.numpy()[never]), v.path
    # compact too: each variable keeps its count; the first swap into a variable makes its step counts
    partial = {e.path for e in frz._optimizers()[0]._enforcers if e.kind != "train"}
    assert sum(h["retraced"] for h in frz.history) <= len(partial)
    assert not any(h["retraced"] for h in frz.history[-3:])


@pytest.mark.slow
def test_drop_is_least_moved_and_regrow_is_largest_gradient():
    m, frz, cb, checker, start, (x, y) = run("restore", keras.optimizers.SGD(0.05), epochs=1)  # swaps after steps 3, 6
    swap = cb.swaps[0]
    assert swap["step"] == 3
    before, after = checker.masks[2], checker.masks[3]  # masks of step 3 and step 4
    values = checker.values[3]  # the values the swap saw (a swap changes masks, not values)
    m2 = mlp(units=(16, 16, 4))
    for v in weights_of(m2):
        v.assign(values[v.path])
    gsum = {v.path: np.zeros(v.shape, np.float64) for v in weights_of(m2)}
    for s in range(0, 32, 16):  # batches=2 of batch_size=16
        for v, g in zip(weights_of(m2), gradients(lambda s=s: LOSS(y[s : s + 16], m2(x[s : s + 16])), weights_of(m2))):
            gsum[v.path] += np.abs(np.asarray(keras.ops.convert_to_numpy(g), np.float64))
    for v, s0 in zip(weights_of(m2), start):
        p = v.path
        tr_b, tr_a = ~before[p], ~after[p]
        if p not in swap["swapped"]:
            assert np.array_equal(tr_b, tr_a), p
            continue
        d = swap["swapped"][p]
        assert d == int(np.floor(0.3 * tr_b.sum() + 0.5))
        moved = np.abs(values[p] - s0).ravel()
        cand = np.flatnonzero(tr_b.ravel())
        dropped = cand[np.lexsort((cand, moved[cand]))][:d]
        frozen = np.flatnonzero(before[p].ravel())
        grown = frozen[np.lexsort((frozen, -gsum[p].ravel()[frozen]))][:d]
        want = tr_b.ravel().copy()
        want[dropped] = False
        want[grown] = True
        assert np.array_equal(tr_a.ravel(), want), p
    assert swap["swapped"]


@pytest.mark.slow
def test_trained_values_follow_a_hand_written_masked_adam_with_fresh_state_for_regrown_elements():
    m, frz, cb, checker, start, (x, y) = run("restore", keras.optimizers.Adam(1e-2), epochs=2)
    ref = mlp(units=(16, 16, 4))
    w = [np.array(s, np.float64) for s in start]
    mom = [np.zeros_like(a) for a in w]
    vel = [np.zeros_like(a) for a in w]
    born = [np.zeros(a.shape) for a in w]
    b1, b2, eps, lr = 0.9, 0.999, 1e-7, 1e-2
    for t, masks in enumerate(checker.masks, start=1):
        if t > 1:  # newly trainable elements start from zero moments and count steps from now
            for i, v in enumerate(weights_of(ref)):
                new = checker.masks[t - 2][v.path] & ~masks[v.path]
                mom[i][new] = 0
                vel[i][new] = 0
                born[i][new] = t - 1
        for a, b in zip(weights_of(ref), w):
            a.assign(b.astype("float32"))
        step = (t - 1) % 6
        xs, ys = x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8]
        g_all = gradients(lambda xs=xs, ys=ys: LOSS(ys, ref(xs, training=True)), weights_of(ref))
        for i, (v, g) in enumerate(zip(weights_of(ref), g_all)):
            tr = ~masks[v.path]
            g = np.asarray(keras.ops.convert_to_numpy(g), np.float64)
            mom[i][tr] += (g[tr] - mom[i][tr]) * (1 - b1)
            vel[i][tr] += (g[tr] ** 2 - vel[i][tr]) * (1 - b2)
            local = t - born[i][tr]
            alpha = lr * np.sqrt(1 - b2**local) / (1 - b1**local)
            w[i][tr] -= alpha * mom[i][tr] / (np.sqrt(vel[i][tr]) + eps)
    for v, ref_w in zip(weights_of(m), w):
        np.testing.assert_allclose(v.numpy(), ref_w, rtol=1e-4, atol=1e-5, err_msg=v.path)
    frz.verify()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"every": 0}, "every"), ({"every": 2, "fraction": 0}, "fraction"), ({"every": 2, "batches": -1}, "batches")],
)
def test_bad_arguments_are_plan_errors(kwargs, match):
    with pytest.raises(ff.PlanError, match=match):
        ff.callbacks.Reselect(data(), **kwargs)


def test_a_plan_without_partial_variables_is_refused_before_the_first_step():
    m = mlp()
    x, y = data()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD()), loss=LOSS)
    before = [np.array(v.numpy(), copy=True) for v in weights_of(m)]
    with pytest.raises(ff.PlanError, match="no partially frozen variable"):
        m.fit(x, y, verbose=0, callbacks=[ff.callbacks.Reselect((x, y), every=2)])
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, weights_of(m)))


@pytest.mark.slow
def test_reselect_outside_fit_and_the_plan_keeps_its_batchnorm_option():
    m = mlp(units=(16, 16, 4), bn=True)
    x, y = data()
    chosen = ff.select(m, (x, y), budget=0.1, score="fisher", loss=LOSS, include="**/head/**", options={"verbose": 0})
    frz = ff.Freezer(m, ff.Plan(chosen.rules, batchnorm="frozen"))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=LOSS)
    m.fit(x, y, batch_size=8, verbose=0)
    cb = ff.callbacks.Reselect((x, y), every=3, freezer=frz)
    cb.set_model(m)
    plan = cb.reselect()  # a public method: works outside fit too
    assert plan is frz.plan and plan.batchnorm == "frozen"
    assert cb.swaps and sum(cb.swaps[-1]["swapped"].values()) > 0
    frz.verify()


@pytest.mark.slow
def test_reselect_finds_the_freezer_of_a_loaded_model(tmp_path):
    """Like the schedules, Reselect asks Freezer.of: a model from load_model has no Freezer until then."""
    m, frz, _, _, _, (x, y) = run("restore", keras.optimizers.Adam(1e-2), epochs=1)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    cb = ff.callbacks.Reselect((x, y), every=3, fraction=0.3, batches=2, batch_size=16)
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.freezer is ff.Freezer.of(loaded)
    cb.freezer.verify()
