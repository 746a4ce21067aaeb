"""Resuming after a crash: a run killed after plan changes and started again ends bit-identical.

Keras' ``BackupAndRestore`` saves weights (with the optimizer's variables)
and, on restart, loads them into an optimizer built for the plan the new
process starts with. Each test kills a run at one point (a callback raising,
``os._exit`` or a real SIGKILL of a child process), builds everything again
as a new process would, resumes, and compares weights, optimizer variables,
the iteration count, the plan in force and ``verify()``'s baseline with an
uninterrupted run, bit for bit.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of

ROOT = pathlib.Path(__file__).resolve().parent.parent
rng = np.random.default_rng(7)
X = rng.normal(size=(48, 6)).astype("float32")
Y = rng.normal(size=(48, 3)).astype("float32")
GROUPS = ["**/block2/**", "**/block1/**"]  # block0 stays partially frozen to the end
#: the head trains, and three input columns of block0's kernel (a partially frozen variable from the start)
START = ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/block0/kernel[:3]")])
EPOCHS = 4


class Stop(Exception):
    pass


class Kill(keras.callbacks.Callback):
    """Stands for a crash: raises at the end of ``epoch`` (after BackupAndRestore saved), or at one batch."""

    def __init__(self, epoch, batch=None):
        super().__init__()
        self.epoch, self.batch, self.now = epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.now = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.batch is not None and self.now == self.epoch and batch == self.batch:
            raise Stop

    def on_epoch_end(self, epoch, logs=None):
        if self.batch is None and epoch == self.epoch:
            raise Stop


class UpdateAt(keras.callbacks.Callback):
    """A plan change made by hand from a callback (``Freezer.update``) at the start of an epoch."""

    def __init__(self, epoch, plan):
        super().__init__()
        self.epoch, self.plan = epoch, plan

    def on_epoch_begin(self, epoch, logs=None):
        if epoch >= self.epoch and ff.Freezer.of(self.model).plan is not self.plan:
            ff.Freezer.of(self.model).update(self.plan)


def build():
    """A fresh model, Freezer and optimizer, as a new process builds them."""
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))] + [keras.layers.Dense(5, name=f"block{i}") for i in range(3)]
    model = keras.Sequential([*layers, keras.layers.Dense(3, name="head")], name="net")
    frz = ff.Freezer(model, START)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.02, weight_decay=0.1)), loss="mse")
    return model, frz


def schedule(kind):
    if kind == "gradual":
        return [ff.callbacks.GradualUnfreezing(GROUPS)]
    if kind == "by_step":  # every 5 steps, one more block; 6 steps per epoch
        return [ff.callbacks.FreezeSchedule({5: [*START.rules, ff.train(GROUPS[0])], 14: ff.Plan()}, by="step")]
    if kind == "update":
        return [UpdateAt(2, ff.Plan([ff.freeze("**/block1/**"), ff.train("**/block1/bias[0]")]))]
    if kind == "reselect":
        return [ff.callbacks.Reselect((X, Y), every=4, fraction=0.5, batch_size=8)]
    raise AssertionError(kind)


def fit(model, callbacks, epochs=EPOCHS):
    model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def state(model, frz):
    opt = model.optimizer
    return {
        "weights": [np.array(w) for w in model.get_weights()],
        "optimizer": [np.array(keras.ops.convert_to_numpy(v)) for v in opt.variables],
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        "trainable": {v.path: frz.frozen_mask(v.path).tobytes() for v in frz.trainable_variables},
    }


def assert_same(got, want):
    assert got["iterations"] == want["iterations"]
    assert got["trainable"] == want["trainable"]
    assert len(got["weights"]) == len(want["weights"])
    for a, b in zip(got["weights"], want["weights"]):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert len(got["optimizer"]) == len(want["optimizer"])
    for a, b in zip(got["optimizer"], want["optimizer"]):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()


_STRAIGHT: dict = {}


def straight(kind):
    if kind not in _STRAIGHT:
        model, frz = build()
        fit(model, schedule(kind))
        frz.verify()
        _STRAIGHT[kind] = state(model, frz)
    return _STRAIGHT[kind]


def interrupted_then_resumed(kind, tmp_path, kill, save_freq="epoch"):
    backup = str(tmp_path / "backup")
    model, _ = build()
    with pytest.raises(Stop):
        fit(model, [*schedule(kind), keras.callbacks.BackupAndRestore(backup, save_freq=save_freq), kill])
    del model
    model, frz = build()  # everything again, as a new process: the plan it starts with is START
    fit(model, [*schedule(kind), keras.callbacks.BackupAndRestore(backup, save_freq=save_freq)])
    return model, frz


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [0, 1, 3], ids=["before-the-first-release", "after-one-release", "last-epoch"])
def test_gradual_unfreezing_killed_and_resumed_is_the_uninterrupted_run(kill_at, tmp_path):
    model, frz = interrupted_then_resumed("gradual", tmp_path, Kill(kill_at, batch=None if kill_at < 3 else 2))
    assert_same(state(model, frz), straight("gradual"))
    frz.verify()
    # the baseline is live: a frozen element changed behind the plan's back is found
    partial = [v for v in weights_of(model) if frz.variable_state(v.path) == "partial"][0]
    values = keras.ops.convert_to_numpy(partial).copy()
    values[-1, -1] += 1.0
    partial.assign(values)
    with pytest.raises(ff.FrozenValueChanged, match="block0/kernel"):
        frz.verify()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["by_step", "update", "reselect"])
def test_other_plan_changes_killed_and_resumed_are_the_uninterrupted_run(kind, tmp_path):
    model, frz = interrupted_then_resumed(kind, tmp_path, Kill(2))
    assert_same(state(model, frz), straight(kind))
    frz.verify()


def test_a_save_in_the_middle_of_an_epoch_loads_as_it_was_saved(tmp_path):
    """save_freq in steps: the checkpoint written after step 9 (a plan change at step 5 before it) loads exactly.

    Keras restarts the epoch in progress from its first batch (its metadata
    keeps the epoch only), so a run killed mid-epoch repeats that epoch's
    first batches as plain Keras does; what finefreeze owes is that the plan,
    the optimizer state and the step load as they were saved.
    """
    backup = str(tmp_path / "backup")
    seen = {}

    class Snap(keras.callbacks.Callback):  # listed after BackupAndRestore: sees what it has just saved
        def __init__(self, when):
            super().__init__()
            self.when = when

        def on_train_batch_end(self, batch, logs=None):
            frz = ff.Freezer.of(self.model)
            frz._sync()
            if frz._step == 9:
                seen["saved"] = state(self.model, frz)

        def on_train_begin(self, logs=None):
            if self.when == "load":
                frz = ff.Freezer.of(self.model)
                frz._sync()
                seen["loaded"] = state(self.model, frz)

    model, _ = build()
    cbs = [*schedule("by_step"), keras.callbacks.BackupAndRestore(backup, save_freq=9)]
    with pytest.raises(Stop):
        fit(model, [*cbs, Snap("save"), Kill(1, batch=4)])
    model, frz = build()
    fit(model, [*schedule("by_step"), keras.callbacks.BackupAndRestore(backup, save_freq=9), Snap("load")], epochs=2)
    assert_same(seen["loaded"], seen["saved"])
    assert frz.history[1]["resumed"] is True and frz.history[1]["step"] == 9


def test_a_custom_loop_resumes_from_save_weights(tmp_path):
    """The documented custom-loop checkpoint: ``model.save_weights`` / ``model.load_weights``."""
    release = ff.Plan([*START.rules, ff.train(GROUPS[0])])

    def run(steps, frm=None, to=None):
        model, frz = build()
        opt = model.optimizer
        if frm is not None:
            model.load_weights(frm)  # an unbuilt optimizer: built on the model, then the saved plan is put in force
        loss = keras.losses.MeanSquaredError()
        start = int(keras.ops.convert_to_numpy(opt.iterations))
        for step in range(start, steps):
            if step == 3 and frz.plan is not release and frz.history[-1].get("resumed") is not True:
                frz.update(release)
            x, y = X[8 * (step % 6) : 8 * (step % 6) + 8], Y[8 * (step % 6) : 8 * (step % 6) + 8]
            grads = ff_grads(model, loss, x, y)
            opt.apply(grads, model.trainable_variables)
            if to is not None and step == 5:
                model.save_weights(to)
                return None
        return state(model, frz), frz

    want, _ = run(10)
    run(10, to=str(tmp_path / "step5.weights.h5"))
    got, frz = run(10, frm=str(tmp_path / "step5.weights.h5"))
    assert_same(got, want)
    frz.verify()


def ff_grads(model, loss, x, y):
    """The gradient of ``loss`` for the model's trainable variables, on the backend in use."""
    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, variables)
    if backend == "jax":
        import jax

        def f(tv):
            out, _ = model.stateless_call(tv, [v.value for v in model.non_trainable_variables], x, training=True)
            return loss(y, out)

        return jax.grad(f)([v.value for v in variables])
    import torch

    model.zero_grad()
    value = loss(torch.as_tensor(y), model(torch.as_tensor(x), training=True))
    value.backward()
    return [v.value.grad for v in variables]


# -- real processes killed for real -------------------------------------------------------------
WORKER = ROOT / "tests" / "resume_worker.py"


def _worker(*args, wait=True):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, str(WORKER), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="processes killed by the OS: one backend's run is the check")
def test_processes_killed_by_os_exit_and_sigkill_resume_bit_identical(tmp_path):
    straight_out = tmp_path / "straight.npz"
    got = _worker("run", tmp_path / "b0", straight_out, "none")
    assert got.returncode == 0, got.stderr[-3000:]
    want = np.load(straight_out)
    # os._exit from a callback right after the first release (end of epoch 1)
    got = _worker("run", tmp_path / "b1", tmp_path / "x.npz", "exit:1")
    assert got.returncode == 3, got.stderr[-3000:]
    # a real SIGKILL in the last epoch, sent from here while the child waits at its third batch
    child = _worker("run", tmp_path / "b2", tmp_path / "y.npz", "wait:3", wait=False)
    deadline = time.monotonic() + 300
    while not (tmp_path / "b2" / "waiting").exists():
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()[1][-3000:]
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    for backup in ("b1", "b2"):
        out = tmp_path / f"{backup}.npz"
        got = _worker("run", tmp_path / backup, out, "none")
        assert got.returncode == 0, got.stderr[-3000:]
        assert "Skipping variable loading" not in got.stderr
        resumed = np.load(out)
        assert sorted(resumed.files) == sorted(want.files)
        for k in want.files:
            assert resumed[k].tobytes() == want[k].tobytes(), (backup, k)


def test_weights_loaded_before_compile_into_a_model_built_otherwise_are_verify_s_baseline(tmp_path):
    """A model built with other initial values, a Freezer, ``load_weights``, then ``compile``: verify is right."""
    plan = ff.Plan([ff.freeze("**/a/**"), ff.freeze("**/b/kernel[0]")])

    def build(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(5, name="a"), keras.layers.Dense(3, name="b")], name="m"
        )

    first = build(1)
    frz = ff.Freezer(first, plan)
    first.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    first.fit(X, Y, epochs=1, verbose=0)
    first.save_weights(tmp_path / "run.weights.h5")
    saved = {v.path: np.array(keras.ops.convert_to_numpy(v)) for v in first.weights}

    again = build(2)  # other initial values
    frz = ff.Freezer(again, plan)
    again.load_weights(tmp_path / "run.weights.h5")
    again.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    again.fit(X, Y, epochs=1, verbose=0)
    frz.verify()
    kernel = np.array(keras.ops.convert_to_numpy(again.get_layer("b").kernel))
    assert np.array_equal(kernel[0], saved["m/b/kernel"][0])
    for v in again.get_layer("a").weights:
        assert np.array_equal(np.array(keras.ops.convert_to_numpy(v)), saved[v.path])
    again.get_layer("a").kernel.assign(again.get_layer("a").kernel + 1.0)  # a frozen element moves: verify says so
    with pytest.raises(ff.FrozenValueChanged, match="m/a/kernel"):
        frz.verify()


def test_a_model_saved_before_its_first_step_loads_with_its_plan_and_trains_it(tmp_path):
    """Saved after compile, before fit: the optimizer saved no masks; the loaded model takes its saved plan."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, name="block"), keras.layers.Dense(3, name="head")], name="m"
    )
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("**/block/kernel[:3]")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    model.save(tmp_path / "m.keras")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")  # Keras: no state saved
        loaded = keras.models.load_model(tmp_path / "m.keras")
    again = ff.Freezer.of(loaded)
    assert np.array_equal(again.frozen_mask("block/kernel"), frz.frozen_mask("m/block/kernel"))
    kernel = loaded.get_layer("block").kernel
    before = np.array(keras.ops.convert_to_numpy(kernel))
    loaded.fit(X, Y, epochs=1, verbose=0)
    after = np.array(keras.ops.convert_to_numpy(kernel))
    again.verify()
    assert np.array_equal(after[3:], before[3:]) and not np.array_equal(after[:3], before[:3])
