"""A training process for tests/test_resume.py: GradualUnfreezing under BackupAndRestore, killed on request.

Usage: ``resume_worker.py run BACKUP_DIR OUT.npz KILL`` where KILL is ``none``,
``exit:E`` (``os._exit(3)`` at the end of epoch E, after the backup) or
``wait:B`` (at batch B of the last epoch, write BACKUP_DIR/waiting and sleep
until killed). A finished run writes its weights and optimizer variables to
OUT.npz.
"""

import os
import pathlib
import sys
import time

import keras
import numpy as np

import finefreeze as ff


def main(backup: str, out: str, kill: str) -> None:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(48, 6)).astype("float32"), rng.normal(size=(48, 3)).astype("float32")
    layers = [keras.Input((6,))] + [keras.layers.Dense(5, name=f"block{i}") for i in range(3)]
    model = keras.Sequential([*layers, keras.layers.Dense(3, name="head")], name="net")
    plan = ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/block0/kernel[:3]")])
    frz = ff.Freezer(model, plan, strategy="compact")
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.02, use_ema=True)), loss="mse")
    how, _, at = kill.partition(":")

    class Kill(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_epoch_end(self, epoch, logs=None):
            if how == "exit" and epoch == int(at):
                os._exit(3)

        def on_train_batch_begin(self, batch, logs=None):
            if how == "wait" and self.epoch == 3 and batch == int(at):
                (pathlib.Path(backup) / "waiting").write_text(str(os.getpid()))
                time.sleep(600)

    groups = ["**/block2/**", "**/block1/**"]
    callbacks = [keras.callbacks.BackupAndRestore(backup), ff.callbacks.GradualUnfreezing(groups), Kill()]
    model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    frz.verify()
    arrays = [np.asarray(w) for w in model.get_weights()]
    arrays += [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.optimizer.variables]
    np.savez(out, *arrays)


if __name__ == "__main__":
    main(*sys.argv[2:5])
