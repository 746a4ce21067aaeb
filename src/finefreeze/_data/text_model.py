"""A small bundled text model, built deterministically, for the CLI and docs."""

from __future__ import annotations

import keras
import numpy as np

from finefreeze._backends.randomness import set_seed
from finefreeze._data.layers import PositionEmbedding

__all__ = [
    "build_text_model",
    "PositionEmbedding",
    "DEFAULT_PLAN",
    "VOCAB",
    "NEW_TOKENS",
    "CLASSES",
    "make_data",
    "pretrained_text_model",
    "extend_vocabulary",
]

VOCAB = 512  #: tokens the "pretrained" model knows
NEW_TOKENS = 32  #: tokens added for fine-tuning
SEQ = 16
CLASSES = 4  #: labels of the classification task


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

    set_seed(seed)
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
    out = layers.Dense(CLASSES, name="head")(x)
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


def make_data(n: int, *, new_tokens: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The bundled task, generated deterministically.

    Every token has a class: ``token % CLASSES`` for the pretrained
    vocabulary, ``(token - VOCAB) % CLASSES`` for new tokens. Pretraining data
    (``new_tokens=False``) is labelled by the most frequent class among its
    tokens; fine-tuning data puts one new token at 4 random positions and is
    labelled by that token's class, so only a model that learns the new
    tokens' embeddings can solve it.

    Args:
        n: number of sequences.
        new_tokens: fine-tuning data (with new tokens) or pretraining data.
        seed: random seed.

    Returns:
        ``(x, y)``: int32 tokens of shape ``(n, SEQ)`` and int32 labels ``(n,)``.

    Example:
        >>> x, y = make_data(8, new_tokens=True)
        >>> x.shape, y.shape, int(x.max()) >= VOCAB
        ((8, 16), (8,), True)
    """
    rng = np.random.default_rng(seed + (1000 if new_tokens else 0))
    x = rng.integers(0, VOCAB, size=(n, SEQ)).astype(np.int32)
    if not new_tokens:
        counts = np.stack([(x % CLASSES == c).sum(axis=1) for c in range(CLASSES)], axis=1)
        return x, counts.argmax(axis=1).astype(np.int32)
    tok = rng.integers(VOCAB, VOCAB + NEW_TOKENS, size=n).astype(np.int32)
    for i in range(n):
        x[i, rng.choice(SEQ, size=4, replace=False)] = tok[i]
    return x, ((tok - VOCAB) % CLASSES).astype(np.int32)


def extend_vocabulary(model, new_tokens: int = NEW_TOKENS, seed: int = 1):
    """A copy of ``model`` whose token embedding has ``new_tokens`` more rows.

    Pretrained rows and every other weight are copied bit for bit; new rows
    are drawn like Keras' default embedding initializer (uniform in
    ``[-0.05, 0.05]``) from ``seed``.

    Args:
        model: a model built by :func:`build_text_model`.
        new_tokens: rows to add.
        seed: seed of the new rows.

    Returns:
        The extended ``keras.Model``.

    Example:
        >>> m = extend_vocabulary(build_text_model(vocab=VOCAB))
        >>> tuple(m.get_layer("token_embedding").embeddings.shape)
        (544, 32)
    """
    old = model.get_layer("token_embedding").embeddings.numpy()
    big = build_text_model(vocab=old.shape[0] + new_tokens)
    for src, dst in zip(model.layers, big.layers):
        if src.name == "token_embedding":
            rng = np.random.default_rng(seed)
            rows = rng.uniform(-0.05, 0.05, size=(new_tokens, old.shape[1])).astype(old.dtype)
            dst.embeddings.assign(np.concatenate([old, rows]))
        else:
            for a, b in zip(src.weights, dst.weights):
                b.assign(a)
    return big


def pretrained_text_model(*, epochs: int = 3, n: int = 4096, verbose: int = 0, callbacks=None):
    """The bundled "pretrained" model: trained on :func:`make_data` then extended.

    Trains :func:`build_text_model` on the pretraining task (a few seconds on
    a CPU), then adds ``NEW_TOKENS`` rows to its token embedding.

    Args:
        epochs: pretraining epochs.
        n: pretraining sequences.
        verbose: Keras verbosity of the pretraining ``fit``.
        callbacks: Keras callbacks of the pretraining ``fit``.

    Returns:
        The extended model, vocabulary ``VOCAB + NEW_TOKENS``.
    """
    model = build_text_model(vocab=VOCAB)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = make_data(n, new_tokens=False)
    model.fit(x, y, epochs=epochs, batch_size=64, verbose=verbose, callbacks=callbacks)
    return extend_vocabulary(model)
