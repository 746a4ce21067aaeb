"""A run resumed from a checkpoint has the saved *plan* in force, not only the saved masks.

After ``BackupAndRestore`` or ``keras.models.load_model`` the Freezer's plan,
its summary and report name the saved rules (the stage a schedule had
reached), and the schedule recognises that stage: it goes on to the next
one, and the run ends with the same rules as an uninterrupted run.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff

X = np.random.default_rng(0).normal(size=(24, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(24, 3)).astype("float32")
GROUPS = ["**/block2/**", "**/block1/**"]
START = ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/block0/kernel[:3]")])
RELEASED = repr(ff.train(GROUPS[0]))  # the rule the first stage adds


def build():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((6,))] + [keras.layers.Dense(5, name=f"block{i}") for i in range(3)]
    model = keras.Sequential([*layers, keras.layers.Dense(3, name="head")], name="net")
    frz = ff.Freezer(model, START)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.02)), loss="mse")
    return model, frz


class Stop(Exception):
    pass


class StopAt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise Stop()


class Probe(keras.callbacks.Callback):
    """What the Freezer in force says when training (re)starts: after BackupAndRestore restored it."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def on_train_begin(self, logs=None):
        frz = ff.Freezer.of(self.model)
        self.seen = {
            "rules": [repr(r) for r in frz.plan.rules],
            "summary": frz.summary(),
            "report": frz.report()["plan"],
        }


def stage_rules(k):
    return [repr(r) for r in START.rules] + [repr(ff.train(g)) for g in GROUPS[:k]]


def test_backup_and_restore_puts_the_saved_plan_back_and_the_schedule_goes_on(tmp_path):
    backup = str(tmp_path / "backup")
    model, _ = build()
    with pytest.raises(Stop):  # killed at the start of epoch 2: the checkpoint holds stage 1's plan
        model.fit(X, Y, epochs=4, verbose=0, callbacks=[
            ff.callbacks.GradualUnfreezing(GROUPS), keras.callbacks.BackupAndRestore(backup), StopAt(2)])  # fmt: skip
    model, frz = build()  # a new process: everything built again with the starting plan
    probe, schedule = Probe(), ff.callbacks.GradualUnfreezing(GROUPS)
    model.fit(X, Y, epochs=4, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), probe, schedule])
    assert probe.seen["rules"] == stage_rules(1)  # the saved plan, not START with the saved masks
    assert RELEASED in probe.seen["summary"] and RELEASED in probe.seen["report"]
    assert [repr(r) for r in schedule.stage_plan(0).rules] == stage_rules(0)  # the stage recognised
    assert [repr(r) for r in ff.Freezer.of(model).plan.rules] == stage_rules(2)  # and the next one reached
    ff.Freezer.of(model).verify()


def test_load_model_puts_the_saved_plan_back_and_the_schedule_goes_on(tmp_path):
    model, _ = build()
    model.fit(X, Y, epochs=2, verbose=0, callbacks=[ff.callbacks.GradualUnfreezing(GROUPS)])
    model.save(tmp_path / "mid.keras")
    loaded = keras.models.load_model(tmp_path / "mid.keras")
    frz = ff.Freezer.of(loaded)
    assert [repr(r) for r in frz.plan.rules] == stage_rules(1)
    assert RELEASED in frz.summary() and RELEASED in frz.report()["plan"]
    schedule = ff.callbacks.GradualUnfreezing(GROUPS)
    loaded.fit(X, Y, epochs=4, initial_epoch=2, verbose=0, callbacks=[schedule])
    assert [repr(r) for r in schedule.stage_plan(0).rules] == stage_rules(0)
    assert [repr(r) for r in ff.Freezer.of(loaded).plan.rules] == stage_rules(2)
    frz.verify()
