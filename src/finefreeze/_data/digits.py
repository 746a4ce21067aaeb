"""The bundled sparse fine-tuning experiment: a digits MLP, its tasks and weights.

Source task: scikit-learn's digits 0-4 as printed. Target task: digits 5-9
turned a quarter turn, with 50 labelled images per class. The base ends in a
32-unit bottleneck trained only on the source task, so a new head on top of
it sees features made for other shapes: the head alone cannot absorb the
shift, the base has to change.
"""

from __future__ import annotations

import os

import keras
import numpy as np

from finefreeze._backends.randomness import set_seed

__all__ = ["build_digits_model", "source_task", "target_task", "pretrained_digits_model", "WEIGHTS"]

WEIGHTS = os.path.join(os.path.dirname(__file__), "digits_base.npz")
HIDDEN = 1024
BOTTLENECK = 32


def _digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(
            "the digits experiment needs scikit-learn: pip install 'finefreeze[sparse]' (or pip install scikit-learn)."
        ) from None
    d = load_digits()
    return (d.images / 16.0).astype("float32"), d.target.astype("int32")


def build_digits_model(classes: int = 5, seed: int = 0) -> keras.Model:
    """An MLP on 8x8 digits: 64 -> 1024 -> 1024 -> 32 (the base) -> ``classes`` (the head).

    Args:
        classes: outputs of the head.
        seed: weights are drawn from this seed.

    Returns:
        A built ``keras.Model`` named ``digits`` (1,148,960 parameters in the base).

    Example:
        >>> m = build_digits_model()
        >>> m.count_params()
        1149125
    """
    set_seed(seed)
    x = inp = keras.Input((64,), name="pixels")
    x = keras.layers.Dense(HIDDEN, activation="relu", name="dense_1")(x)
    x = keras.layers.Dense(HIDDEN, activation="relu", name="dense_2")(x)
    x = keras.layers.Dense(BOTTLENECK, activation="relu", name="bottleneck")(x)
    out = keras.layers.Dense(classes, name="head")(x)
    return keras.Model(inp, out, name="digits")


def source_task():
    """``(x, y)`` of the source task: every digit 0-4, upright, labels 0-4."""
    images, labels = _digits()
    keep = labels < 5
    return images[keep].reshape(-1, 64), labels[keep]


def target_task(seed: int = 0, per_class: int = 50):
    """``(x_train, y_train), (x_test, y_test)`` of the target task.

    Digits 5-9 turned a quarter turn counter-clockwise, labels 0-4;
    ``per_class`` training images per class drawn with ``seed``, the rest for
    testing.

    Args:
        seed: which images are the training ones.
        per_class: labelled images per class.

    Returns:
        Two ``(x, y)`` pairs of float32 ``(n, 64)`` pixels and int32 labels.

    Example:
        >>> (x, y), (xt, yt) = target_task()
        >>> x.shape, sorted(set(y.tolist())), len(xt) + len(x)
        ((250, 64), [0, 1, 2, 3, 4], 896)
    """
    images, labels = _digits()
    keep = labels >= 5
    x = np.rot90(images[keep], k=1, axes=(1, 2)).reshape(-1, 64).copy()
    y = labels[keep] - 5
    rng = np.random.default_rng(seed)
    train = np.zeros(len(y), bool)
    for c in range(5):
        idx = np.flatnonzero(y == c)
        train[rng.choice(idx, per_class, replace=False)] = True
    return (x[train], y[train]), (x[~train], y[~train])


def pretrained_digits_model(classes: int = 5, seed: int = 0) -> keras.Model:
    """The base pretrained on :func:`source_task` (shipped weights), with a fresh head.

    Args:
        classes: outputs of the new head.
        seed: draws the new head's weights.

    Returns:
        The model, its base loaded from the bundled float16 weights.
    """
    model = build_digits_model(classes, seed=seed)
    with np.load(WEIGHTS) as w:
        for v in model.weights:
            if not v.path.startswith("head/"):
                v.assign(w[v.path].astype("float32"))
    return model
