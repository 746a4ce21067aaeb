"""``gradients="auto"`` (the default): slices get their own weight gradient where the benchmarks measured it cheaper.

What auto decides is :func:`finefreeze._slices.choose.pays`; these tests
check that the layers follow it, that auto's training is the sliced path's
bit for bit where it slices and the dense path's where it does not, and the
two cases where auto keeps a slice on the dense gradient on purpose: a plan
that changes often (``update(..., often=True)``, as ``Reselect`` calls it),
and a FreezeBoard recording the frozen gradient's norm. Backend-neutral.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import strategy_of, weights_of
from finefreeze._slices.choose import MARK, kernel_slice, pays

BACKEND = keras.backend.backend()
W = 256  # big enough that slicing pays on every backend (AUTO_PAYS)


def model(seed=0):
    keras.utils.set_random_seed(seed)
    i = keras.Input((W,))
    h = keras.layers.Dense(W, activation="relu", name="big")(i)
    h = keras.layers.Dense(8, activation="relu", name="small")(h)
    return keras.Model(i, keras.layers.Dense(3, name="head")(h), name="m")


def data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, W)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def numpy(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


PLAN = ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, :8]"), ff.train("**/small/kernel[:, :2]")])


def gradient_of(frz, path):
    return {v["path"]: v["gradient"] for v in frz.report()["variables"]}[path]


def sliced_layers(m):
    """The layers whose call computes their slice's weight gradient only (a kernel held dense keeps a mark)."""
    return sorted(layer.name for layer in m.layers if MARK in layer.__dict__ and layer.__dict__[MARK].now())


def train(gradients, plan=PLAN, epochs=2):
    m = model()
    frz = ff.Freezer(m, plan, gradients=gradients)
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    before = {v.path: numpy(v) for v in weights_of(m)}
    x, y = data()
    m.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    frz.verify()
    for v in weights_of(m):
        frozen = frz.frozen_mask(v.path)
        assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
    return m, frz


def test_auto_is_the_default_and_slices_what_pays():
    m = model()
    frz = ff.Freezer(m, PLAN)
    assert frz._gradients == "auto"
    expected = []
    for layer in m.layers:
        if getattr(layer, "kernel", None) is None or frz.variable_state(layer.kernel.path) != "partial":
            continue
        ks = kernel_slice(layer, layer.kernel, frz.frozen_mask(layer.kernel.path))
        if ks is not None and pays(ks):
            expected.append(layer.name)
    assert expected == ["big"]  # a 256 x 256 kernel at 3 %; the 256 x 8 one is too small to pay
    assert sliced_layers(m) == expected
    assert gradient_of(frz, "big/kernel") == "sliced" and gradient_of(frz, "small/kernel") == "dense"


@pytest.mark.parametrize("trained", ["[:, :8]", "[:, :64]", "[:, :128]", "[:, ::10]", "[:, ::4]", "[:26]"])
def test_the_layers_follow_what_pays_on_this_backend(trained):
    m = model()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/kernel"), ff.train(f"**/big/kernel{trained}")]))
    ks = kernel_slice(m.get_layer("big"), m.get_layer("big").kernel, frz.frozen_mask("big/kernel"))
    assert ks is not None
    assert sliced_layers(m) == (["big"] if pays(ks) else [])
    assert gradient_of(frz, "big/kernel") == ("sliced" if pays(ks) else "dense")
    assert sliced_layers(ff.Freezer(model(), frz.plan, gradients="sliced")._target.obj) == ["big"]


def test_what_pays_is_the_measured_table():
    d = keras.layers.Dense(256)
    d.build((None, 256))

    def block(trained):
        frozen = np.ones((256, 256), bool)
        frozen[trained] = False
        return kernel_slice(d, d.kernel, frozen)

    ten, quarter, half = block(np.s_[:, :26]), block(np.s_[:, :64]), block(np.s_[:, :128])
    every_tenth, every_fourth = block(np.s_[:, ::11]), block(np.s_[:, ::4])
    assert [pays(s, "tensorflow") for s in (ten, quarter, half, every_tenth)] == [True, True, False, False]
    assert [pays(s, "jax") for s in (ten, quarter, half, every_tenth, every_fourth)] == [True, True, True, True, False]
    assert [pays(s, "torch") for s in (half, every_tenth, every_fourth)] == [True, True, True]
    small = keras.layers.Dense(255)
    small.build((None, 256))
    frozen = np.ones((256, 255), bool)
    frozen[:, :2] = False
    assert not any(pays(kernel_slice(small, small.kernel, frozen), b) for b in ("tensorflow", "jax", "torch"))


@pytest.mark.slow
@pytest.mark.parametrize("partial", ["big", "small"])
def test_auto_trains_as_the_sliced_path_where_it_slices_and_as_the_dense_path_elsewhere(partial):
    plan = ff.Plan([ff.freeze(f"**/{partial}/kernel"), ff.train(f"**/{partial}/kernel[:, :2]")])
    kept = {g: train(g, plan) for g in ("auto", "sliced", "dense")}  # the Freezers live: their calls hold
    runs = {g: m for g, (m, _) in kept.items()}
    same = "sliced" if partial == "big" else "dense"  # the small kernel is below AUTO_PAYS' elements
    assert sliced_layers(runs["auto"]) == (["big"] if partial == "big" else [])
    for a, s, d in zip(weights_of(runs["auto"]), weights_of(runs[same]), weights_of(runs["dense"])):
        assert np.array_equal(numpy(a), numpy(s)), a.path
        # against the dense path: float rounding (tests/test_slices.py states the bound)
        scale = max(float(np.abs(numpy(d)).max()), 1e-30)
        assert float(np.abs(numpy(a) - numpy(d)).max()) <= 2e-5 * scale, a.path


def test_a_plan_that_changes_often_keeps_its_moved_slices_dense_and_stops_retracing():
    m, frz = train("auto", epochs=1)
    x, y = data()
    first = m.get_layer("big").__dict__[MARK].slice.key

    def at(start):
        return ff.Plan([ff.freeze("**/kernel"), ff.train(f"**/big/kernel[:, {start}:{start + 8}]")])

    frz.update(at(8))  # a change that is not said to recur: the new slice gets its own gradient (a retrace)
    assert frz.history[-1]["retraced"] and sliced_layers(m) == ["big"]
    assert m.get_layer("big").__dict__[MARK].slice.key != first and frz._held_dense == []
    frz.update(at(16), often=True)  # as Reselect calls it: the dense gradient from now on
    assert frz.history[-1]["retraced"] and sliced_layers(m) == [] and frz._held_dense == ["big/kernel"]
    m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for start in (24, 32):
        before = {v.path: numpy(v) for v in weights_of(m)}
        frz.update(at(start), often=True)
        assert not frz.history[-1]["retraced"] and sliced_layers(m) == []
        m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        frz.verify()
        for v in weights_of(m):
            frozen = frz.frozen_mask(v.path)
            assert np.array_equal(numpy(v)[frozen], before[v.path][frozen]), v.path
    assert gradient_of(frz, "big/kernel") == "dense"


def test_a_refused_change_leaves_the_kernels_held_as_they_were():
    m, frz = train("auto", epochs=1)
    with pytest.raises(ff.PlanError):
        plan = ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, 8:16]"), ff.train("**/nothere")])
        frz.update(plan, often=True)
    assert frz._held_dense == [] and sliced_layers(m) == ["big"]


def test_kernels_held_dense_stay_dense_in_a_loaded_model_which_resumes_bit_for_bit(tmp_path):
    m, frz = train("auto", epochs=1)
    frz.update(ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, 8:16]")]), often=True)
    x, y = data()
    m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    again = ff.Freezer.of(loaded)
    assert again._gradients == "auto" and again._held_dense == ["big/kernel"] and sliced_layers(loaded) == []
    m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    again.verify()
    for a, b in zip(weights_of(loaded), weights_of(m)):
        assert np.array_equal(numpy(a), numpy(b)), a.path


def test_freezeboard_under_auto_watches_the_path_auto_takes(tmp_path):
    """The board observes: ``auto`` slices with it as without it; the frozen norm is of what the step computes."""
    pytest.importorskip("tensorboard")  # an optional install: FreezeBoard's own test checks its install hint
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    norms, x, y = {}, *data()
    for gradients in ("auto", "sliced", "dense"):
        m = model()
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, :8]")]), gradients=gradients)
        m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.01)), loss="mse")
        board = ff.callbacks.FreezeBoard(tmp_path / gradients, frz)
        m.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[board])
        norms[gradients] = board.last_gradient_norms
        acc = EventAccumulator(str(tmp_path / gradients), size_guidance={"tensors": 0})
        acc.Reload()
        (text,) = [make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors("freeze/summary")]
        assert ("sliced]" in text) == (gradients != "dense"), text  # what this fit computed
        assert gradient_of(frz, "big/kernel") == ("dense" if gradients == "dense" else "sliced")
    assert norms["sliced"][1] == 0.0 == norms["auto"][1] and norms["dense"][1] > 0.0
    assert norms["auto"] == norms["sliced"]  # the same step: auto's, with the board or without it


def _job(directory, crash):
    """Three epochs; a callback moves the slice at epoch 1 as Reselect would (often=True); optionally a crash.

    20 columns of 256: more than the 5 % ``auto`` compacts without a slice, so a layout that followed the
    gradient computed now would turn ``restore`` once the kernel is held dense.
    """
    x, y = data()

    def at(start):
        return ff.Plan([ff.freeze("**/kernel"), ff.train(f"**/big/kernel[:, {start}:{start + 20}]")])

    class Move(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                frz.update(at(20), often=True)

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    m = model()
    frz = ff.Freezer(m, at(0))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    callbacks = [Move(), keras.callbacks.BackupAndRestore(str(directory))] + ([Crash()] if crash else [])
    try:
        m.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    except KeyboardInterrupt:
        assert frz._held_dense == ["big/kernel"]
    return m, frz


def test_a_run_that_held_a_kernel_dense_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    plain, _ = _job(tmp_path / "plain", crash=False)
    _job(tmp_path / "run", crash=True)
    resumed, frz = _job(tmp_path / "run", crash=False)  # the same script again, in a fresh model
    assert frz._held_dense == ["big/kernel"] and sliced_layers(resumed) == []
    assert strategy_of(frz, "big/kernel") == "compact"
    frz.verify()
    for a, b in zip(weights_of(resumed), weights_of(plain)):
        assert np.array_equal(numpy(a), numpy(b)), a.path


def test_a_loaded_model_that_trains_without_its_freezer_says_it_takes_the_dense_gradient(tmp_path):
    m, frz = train("auto", epochs=1)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    x, y = data()
    with pytest.warns(ff.FreezeWarning, match=r"gradients='auto'.*ff\.Freezer\.of\(model\) after load_model"):
        loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize("often", ["yes", 1, None])
def test_often_takes_a_bool_and_a_refused_value_changes_nothing(often):
    m, frz = train("auto", epochs=1)
    with pytest.raises(ff.PlanError, match=r"often=.*give True .* or False"):
        frz.update(ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, 8:16]")]), often=often)
    assert frz._held_dense == [] and sliced_layers(m) == ["big"] and frz.plan.to_dict() == PLAN.to_dict()


def test_often_holds_nothing_on_sliced_which_slices_whatever_it_costs():
    m, frz = train("sliced", epochs=1)
    frz.update(ff.Plan([ff.freeze("**/kernel"), ff.train("**/big/kernel[:, 8:16]")]), often=True)
    assert frz._held_dense == [] and "big" in sliced_layers(m)


@pytest.mark.parametrize("what", ["columns", "column list", "elements"])
def test_auto_takes_the_memory_saving_path_for_a_kernel_whose_gradient_is_memory_that_matters(what):
    """From MEMORY_AT elements a kernel's slice or scattered elements get their own gradient on every backend."""
    from finefreeze._backends.costs import MEMORY_AT

    side = 1024
    assert side * side >= MEMORY_AT
    i = keras.Input((side,))
    m = keras.Model(i, keras.layers.Dense(side, name="wide")(i))
    if what == "columns":  # 1 % of the columns, in one range
        rule = ff.train("wide/kernel", columns="1%")
    elif what == "column list":  # 1 % of the columns, every 100th (a gather; lists pay at 0 % on TensorFlow)
        rule = ff.train("wide/kernel", mask=np.arange(side) % 100 == 0)
    else:  # 1 % of the elements, scattered (the sampled product pays at 0.1 % on JAX by time alone)
        rule = ff.train("wide/kernel", mask=np.random.default_rng(0).random((side, side)) < 0.01)
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), rule]))
    want = "sampled" if what == "elements" else "sliced"
    assert gradient_of(frz, "wide/kernel") == want


@pytest.mark.backends("jax", "torch", reason="Keras' RematScope on TensorFlow refuses a functional model's call itself")
def test_layers_keras_rematerializes_train_their_slice_and_elements_as_the_dense_path():
    """Under ``keras.RematScope`` a slice and scattered elements get their own gradient (recomputed, as Keras does).

    Keras checkpoints the call; JAX caches a checkpointed function's trace by
    the function, so the layer's own call (one function) is handed to Keras
    anew at every call: before that, the train step reused the symbolic
    build's trace and nothing trained on JAX.
    """
    elements = np.zeros((128, 64), bool)
    elements[np.arange(128), np.arange(128) % 64] = True  # in every row and column: no smaller block holds them

    def trained(gradients):
        keras.utils.set_random_seed(0)
        with keras.RematScope(mode="full"):
            i = keras.Input((64,))
            h = keras.layers.Dense(64, name="b")(keras.layers.Dense(128, name="a")(i))
            m = keras.Model(i, keras.layers.Dense(3, name="head")(h))
        rules = [ff.freeze("**"), ff.train("a/kernel", columns="10%"), ff.train("b/kernel", mask=elements)]
        frz = ff.Freezer(m, ff.Plan(rules), gradients=gradients)
        m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
        before = {p: numpy(m.get_layer(p.split("/")[0]).kernel) for p in ("a/kernel", "b/kernel")}
        x = np.random.default_rng(0).random((32, 64)).astype("float32")
        m.fit(x, x[:, :3], batch_size=8, epochs=2, verbose=0, shuffle=False)
        frz.verify()
        return frz, before, {p: numpy(m.get_layer(p.split("/")[0]).kernel) for p in before}

    frz, before, sliced = trained("sliced")
    assert gradient_of(frz, "a/kernel") == "sliced" and gradient_of(frz, "b/kernel") == "sampled"
    _, _, dense = trained("dense")
    for path, now in sliced.items():
        frozen = frz.frozen_mask(path)
        assert np.array_equal(now[frozen], before[path][frozen]) and (now[~frozen] != before[path][~frozen]).all()
        assert np.abs(now - dense[path]).max() <= 2e-5 * np.abs(dense[path]).max(), path  # test_slices.BOUND
