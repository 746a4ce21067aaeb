"""The Keras layer of the bundled example model, registered for ``keras.models.load_model``.

The models that ``finefreeze finetune`` writes (``base.keras``,
``tuned.keras``) use it. It is registered with Keras under the package name
``finefreeze`` as soon as Keras is imported after ``import finefreeze``, so
such files load with ``import finefreeze`` alone.
"""

from __future__ import annotations

import keras

__all__ = ["PositionEmbedding"]


@keras.saving.register_keras_serializable(package="finefreeze")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a ``(batch, seq, d)`` input.

    Its one weight, ``embeddings``, has the input's shape without the batch
    axis and is drawn from ``random_normal``.

    Example:
        >>> import keras, numpy as np
        >>> from finefreeze._data.layers import PositionEmbedding
        >>> layer = PositionEmbedding(name="pos")
        >>> y = layer(np.zeros((2, 16, 8), "float32"))
        >>> y0, table = keras.ops.convert_to_numpy(y[0]), keras.ops.convert_to_numpy(layer.embeddings)
        >>> tuple(table.shape), bool(np.array_equal(y0, table))
        ((16, 8), True)
    """

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.embeddings
