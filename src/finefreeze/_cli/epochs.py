"""The batches of a ``finetune`` run, and the ``fit`` that takes them.

Batches are shuffled by a permutation drawn from the epoch number alone, so
a run resumed at epoch 3 sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["shuffled", "plain"]


def shuffled(x, y, batch_size: int, epoch: int):
    """The training batches, shuffled by a permutation drawn from the epoch number alone.

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
            return keras.tree.map_structure(lambda a: a[rows], x), y[rows]

        def on_epoch_end(self):
            self.epoch += 1
            self._order()

    return Epochs()


def plain(model, name: str):
    """``model.fit``/``evaluate``; Keras' own for a preset's classifier, whose texts are token ids already.

    KerasHub's versions turn every input into a ``tf.data`` pipeline for its
    preprocessor, which the detached preprocessor does not need and the
    epoch-seeded batches (a ``PyDataset``) cannot pass through.
    """
    if hasattr(model, "_finefreeze_preprocessor"):
        return getattr(keras.Model, name).__get__(model)
    return getattr(model, name)
