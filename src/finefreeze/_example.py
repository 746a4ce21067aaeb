"""A small bundled text model, built deterministically, for the CLI and docs."""

from __future__ import annotations

import keras

__all__ = ["build_text_model", "PositionEmbedding", "DEFAULT_PLAN", "VOCAB", "NEW_TOKENS"]

VOCAB = 512  #: tokens the "pretrained" model knows
NEW_TOKENS = 32  #: tokens added for fine-tuning
SEQ = 16


@keras.saving.register_keras_serializable(package="finefreeze")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a ``(batch, seq, d)`` input."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.embeddings


def build_text_model(vocab: int = VOCAB + NEW_TOKENS, seed: int = 0):
    """Token + position embedding, one transformer block, a classification head.

    Args:
        vocab: vocabulary size (pretrained tokens plus new ones).
        seed: weights are drawn from this seed, so every build is identical.

    Returns:
        A built ``keras.Model`` named ``text_classifier``.

    Example:
        >>> m = build_text_model()
        >>> tuple(m.get_layer("token_embedding").embeddings.shape)
        (544, 32)
    """
    from keras import layers

    keras.utils.set_random_seed(seed)
    d = 32
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, d, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    h = layers.LayerNormalization(name="ln_1")(x)
    h = layers.MultiHeadAttention(num_heads=2, key_dim=16, name="attention")(h, h)
    x = x + h
    h = layers.LayerNormalization(name="ln_2")(x)
    h = layers.Dense(64, activation="gelu", name="ff_in")(h)
    x = x + layers.Dense(d, name="ff_out")(h)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    out = layers.Dense(4, name="head")(x)
    return keras.Model(tokens, out, name="text_classifier")


#: freeze everything except the new tokens' embedding rows and the head
DEFAULT_PLAN = {
    "strict": True,
    "rules": [
        {"freeze": "**"},
        {"train": f"token_embedding/embeddings[{VOCAB}:]"},
        {"train": "head/**"},
    ],
}
