"""The batches of a ``finetune`` run, and the ``fit`` that takes them.

Batches are shuffled by a permutation drawn from the epoch number alone, and
the seed generators' states (dropout) are kept beside the resume point, so
a run resumed at epoch 3 sees the batches and masks an uninterrupted one would.
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np

from finefreeze._backends import randomness
from finefreeze._files.atomic import check_interrupt
from finefreeze._keras.instances import tag
from finefreeze._keras.layers import all_layers, seed_generators

__all__ = ["shuffled", "plain", "seed_states", "stop_on_interrupt"]


def shuffled(x, y, batch_size: int, epoch: int, sample_weight=None):
    """The training batches (with ``sample_weight``'s rows, when given), shuffled by a permutation drawn
    from the epoch number alone.

    Keras' own shuffling draws each epoch's order from a random state that
    the epochs before it advanced; a run resumed at epoch 3 would see
    another order than an uninterrupted one. Here epoch ``e`` always sees
    ``permutation(e)``, so a resumed run trains on the same batches.
    """

    class Epochs(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.epoch = epoch
            self._order()

        def _order(self):
            self.order = np.random.default_rng([0, self.epoch]).permutation(len(y))

        def __len__(self):
            return -(-len(y) // batch_size)

        def __getitem__(self, i):
            rows = self.order[i * batch_size : (i + 1) * batch_size]
            if sample_weight is not None:
                return keras.tree.map_structure(lambda a: a[rows], x), y[rows], sample_weight[rows]
            return keras.tree.map_structure(lambda a: a[rows], x), y[rows]

        def on_epoch_end(self):
            self.epoch += 1
            self._order()

    return Epochs()


def plain(model, name: str):
    """``model.fit``/``evaluate``; Keras' own for a preset's task, whose texts are token ids already.

    KerasHub's versions turn every input into a ``tf.data`` pipeline for its
    preprocessor, which the detached preprocessor does not need and the
    epoch-seeded batches (a ``PyDataset``) cannot pass through.
    """
    if tag(model, "_finefreeze_preprocessor", None) is not None:
        return getattr(keras.Model, name).__get__(model)
    return getattr(model, name)


def _seed_states(model) -> list:
    """The state variables of the model's seed generators (dropout and friends), in layer order."""
    out, seen = [], set()
    for layer in all_layers(model):
        for gen in seed_generators(layer):
            if id(gen) not in seen:
                seen.add(id(gen))
                out.append(gen.state)
    return out


def seed_states(model, folder: str):
    """A callback that keeps the seed states of ``model`` beside the resume point in ``folder``.

    Keras' ``BackupAndRestore`` saves the weights, not the seed generators'
    states (they are variables, not weights), so a resumed run would draw
    the dropout masks of epoch 1 again (PyTorch draws an unseeded dropout's
    masks from its global generator: its state is kept too). After every epoch this writes the
    states to ``seeds-<epochs done>.npz`` (atomically, before the resume
    point of that epoch is written, keeping the one before), and at the
    start of a resumed run it puts back the states of the epoch the resume
    point holds.
    """
    states = _seed_states(model)

    def path(done: int) -> str:
        return os.path.join(folder, f"seeds-{done}.npz")

    class SeedStates(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            try:
                with open(os.path.join(folder, "training_metadata.json")) as f:
                    done = int(json.load(f)["epoch"])
                with np.load(path(done)) as saved:
                    values = [saved[f"s{i}"] for i in range(len(states))]
                    generator = saved["global"] if "global" in saved else None
            except (OSError, ValueError, KeyError, TypeError):
                return  # a fresh run (or no states kept): nothing to put back
            for v, value in zip(states, values):
                v.assign(value)
            if generator is not None:
                randomness.set_global_state(generator)

        def on_epoch_end(self, epoch, logs=None):
            saved = {f"s{i}": np.asarray(keras.ops.convert_to_numpy(v)) for i, v in enumerate(states)}
            generator = randomness.global_state()
            if generator is not None:  # PyTorch's unseeded dropout draws from it
                saved["global"] = generator
            if not saved:
                return
            tmp = path(epoch + 1) + ".tmp.npz"
            np.savez(tmp, **saved)
            os.replace(tmp, path(epoch + 1))
            if os.path.exists(path(epoch - 1)):
                os.remove(path(epoch - 1))

    return SeedStates()


def stop_on_interrupt():
    """A callback that ends ``fit`` or ``evaluate`` at the end of the batch a Ctrl-C or SIGTERM came in.

    Used inside :func:`~finefreeze._files.atomic.interrupts_at_checks`, which
    holds the signal for its checks.
    """

    class StopOnInterrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            check_interrupt()

        def on_test_batch_end(self, batch, logs=None):
            check_interrupt()

        def on_epoch_end(self, epoch, logs=None):  # after BackupAndRestore saved the epoch
            check_interrupt()

    return StopOnInterrupt()
