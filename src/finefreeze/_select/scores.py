"""Per-element scores for :func:`finefreeze.select`, reduced as batches stream.

Every data score keeps at most one float32 accumulator per scored element
and adds each batch into it; no batch's scores are kept. ``fisher`` cuts
each batch into microbatches, so a microbatch of ``m`` examples holds ``m``
per-example gradients for a moment. This module is the one streaming path
for every Keras backend; how a gradient is taken (``tf.GradientTape``,
``jax.grad``, ``torch.func.grad``) is in :mod:`finefreeze._backends.gradients`.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np

from finefreeze._backends import gradients
from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.questions import tensorflow_imported
from finefreeze._errors import PlanError
from finefreeze._slices.product import full_gradients

__all__ = [
    "SCORES",
    "batches",
    "loss_function",
    "next_token_loss",
    "next_token_targets",
    "stream_scores",
    "static_score",
]

SCORES = ("fisher", "gradient", "magnitude", "delta", "random")
DATA_SCORES = ("fisher", "gradient", "delta")


def _pair(b, where: str):
    if isinstance(b, dict) or not isinstance(b, (tuple, list)) or len(b) not in (2, 3):
        raise PlanError(
            f"{where}: each batch must be an (x, y) or (x, y, sample_weight) tuple; got {type(b).__name__}. "
            "Pass data as (x, y) arrays, a tf.data.Dataset of (x, y) batches, or an iterable of them."
        )
    return b[0], b[1]


def batches(data, *, batch_size: int, limit: int | None) -> tuple[Iterator, int | None]:
    """``(iterator over (x, y) batches, number of batches or None)`` from the forms ``fit`` accepts.

    Raises:
        PlanError: ``data`` is none of them.
    """
    if data is None:
        raise PlanError("select: this score needs data; pass data=(x, y), a tf.data.Dataset or an iterable of batches.")
    if isinstance(data, dict):
        raise PlanError(
            f"select: data is a dict (keys {sorted(map(str, data))}); pass data=(x, y) — a model with named "
            "inputs takes the dict as x: data=({'name': array, ...}, y)."
        )
    if isinstance(data, tuple) and len(data) in (2, 3) and not isinstance(data[0], tuple):
        x, y = data[0], data[1]
        n = len(y)
        first = keras.tree.flatten(x)
        if any(len(t) != n for t in first):
            raise PlanError(
                f"select: x and y have different numbers of examples ({[len(t) for t in first]} vs {n}); "
                "pass arrays with one row per example."
            )
        total = -(-n // batch_size)
        total = total if limit is None else min(total, limit)

        def gen():
            for i in range(total):
                s = slice(i * batch_size, (i + 1) * batch_size)
                yield keras.tree.map_structure(lambda t, s=s: t[s], x), y[s]

        return gen(), total
    if not hasattr(data, "__iter__"):
        raise PlanError(
            f"select: data must be (x, y) arrays, a tf.data.Dataset or an iterable of (x, y) batches; "
            f"got {type(data).__name__}."
        )
    total = None
    tf = tensorflow_imported()  # a tf.data.Dataset exists only once TensorFlow is imported
    if tf is not None and isinstance(data, tf.data.Dataset):
        card = int(data.cardinality())
        total = card if card >= 0 else None
    elif hasattr(data, "__len__"):
        total = len(data)
    if limit is not None:
        total = limit if total is None else min(total, limit)

    def gen2():
        for i, b in enumerate(data):
            if limit is not None and i >= limit:
                return
            yield _pair(b, "select")

    return gen2(), total


def loss_function(model, loss, data=None):
    """A callable ``(y_true, y_pred) -> scalar`` from ``loss=`` or the model's compiled loss.

    Strings for a KerasHub causal LM: the next-token cross-entropy over the
    tokens that are not padding (``y`` is ``-1`` there), whatever the task
    was compiled with.

    Raises:
        PlanError: no usable loss.
    """
    if loss is None and is_causal(preprocessor(model)) and _texts(data):
        loss = next_token_loss()
    if loss is None:
        loss = getattr(model, "loss", None)
        if loss is None:
            raise PlanError(
                "select: the model is not compiled with a loss; pass loss= (e.g. "
                "loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))."
            )
    if isinstance(loss, (list, tuple, dict)):
        raise PlanError(f"select: a model with several losses ({loss!r}) needs one loss= for the scores.")
    try:
        fn = keras.losses.get(loss)
    except (ValueError, TypeError) as e:
        raise PlanError(f"select: unknown loss {loss!r} ({e}); pass a keras loss or a callable.") from None
    if not callable(fn):
        raise PlanError(f"select: loss {loss!r} is not callable.")

    def scalar(y, p):
        return keras.ops.mean(keras.ops.cast(fn(y, p), "float32"))

    return scalar


def static_score(name: str, value: np.ndarray, *, largest: bool, rng: np.random.Generator) -> np.ndarray:
    """Score without data: ``magnitude`` (|w|, or -|w| for the smallest) or ``random``."""
    if name == "magnitude":
        a = np.abs(value.astype(np.float32, copy=False))
        return a if largest else np.negative(a, out=a)
    return rng.random(value.shape, dtype=np.float32)


def stream_scores(
    model,
    variables,
    data,
    *,
    score,
    loss,
    batch_size,
    limit,
    microbatch,
    epochs,
    optimizer,
    verbose,
    per_example="auto",
    cache: dict | None = None,
):
    """Accumulate a data score per element of ``variables``; return numpy arrays, one per variable.

    ``fisher``: sum over examples of the squared per-example gradient.
    ``gradient``: sum over batches of the absolute batch gradient.
    ``delta``: |theta after ``epochs`` of training on the data - theta before|;
    every model variable is then assigned back its value from before.
    With a ``cache`` dict (a callback scoring again and again), the
    accumulators and compiled steps are kept there and reused, not released.
    """
    with full_gradients():  # every element is scored: no layer computes the weight gradient of its slice only
        prep = preprocessor(model)
        if cache:
            grads = cache["grads"]
            grads.reset()
            return _stream(grads, data, score, batch_size, limit, microbatch, verbose, keep=True, prep=prep)
        loss_fn = loss_function(model, loss, data)
        if score == "delta":
            return _delta(model, variables, data, loss_fn, batch_size, limit, epochs, optimizer, verbose, prep)
        grads = gradients.make(model, variables, loss_fn, per_example)
        if cache is not None:
            cache["grads"] = grads
        return _stream(grads, data, score, batch_size, limit, microbatch, verbose, keep=cache is not None, prep=prep)


def preprocessor(model):
    """The preprocessor a KerasHub task applies to its data in ``fit`` (raw strings to token ids), or None."""
    prep = getattr(model, "preprocessor", None)
    return prep if isinstance(prep, keras.layers.Layer) else None


def is_causal(prep) -> bool:
    """Whether ``prep`` is a KerasHub causal LM's preprocessor (strings in, ``(x, next ids, mask)`` out)."""
    return prep is not None and callable(getattr(prep, "generate_preprocess", None))


def _texts(data) -> bool:
    if isinstance(data, np.ndarray):
        return data.dtype.kind in "US" or (data.dtype == object and data.size > 0 and isinstance(data.flat[0], str))
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(t, str) for t in data)


def next_token_targets(y, weight) -> np.ndarray:
    """A causal LM's next-token targets with -1 where their weight is 0 (padding, prompts): :func:`next_token_loss`
    leaves them out."""
    return np.where(to_numpy(weight) > 0, to_numpy(y), -1).astype("int32")


def next_token_loss():
    """The next-token cross-entropy on logits over the targets that are not -1 (:func:`next_token_targets`)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)


def _causal_batches(texts, batch_size, limit, prep):
    """``(x, y)`` batches of a causal LM's strings: its preprocessor's ids, the next ids ``-1`` where padding."""
    texts = list(texts)
    total = -(-len(texts) // batch_size)
    total = total if limit is None else min(total, limit)

    def gen():
        for i in range(total):
            x, y, weight = prep(texts[i * batch_size : (i + 1) * batch_size])
            yield keras.tree.map_structure(to_numpy, x), next_token_targets(y, weight)

    return gen(), total


def _batches(data, batch_size, limit, prep):
    """``(iterator, total)`` of ``(x, y)`` batches, through ``prep`` (a KerasHub preprocessor) when given."""
    if is_causal(prep) and _texts(data):
        return _causal_batches(data, batch_size, limit, prep)
    it, total = batches(data, batch_size=batch_size, limit=limit)
    if prep is None:
        return it, total
    return ((keras.tree.map_structure(to_numpy, prep(x)), y) for x, y in it), total


def _stream(grads, data, score, batch_size, limit, microbatch, verbose, *, keep, prep=None):
    it, total = _batches(data, batch_size, limit, prep)
    bar = keras.utils.Progbar(total, verbose=verbose, unit_name="batch")
    seen = 0
    for i, (x, y) in enumerate(it):
        if score == "gradient":
            grads.add("gradient", x, y)
        else:
            n = len(y)
            for s in range(0, n, microbatch):
                sl = slice(s, s + microbatch)
                grads.add("fisher", keras.tree.map_structure(lambda t, sl=sl: t[sl], x), y[sl])
        seen += 1
        bar.update(i + 1)
    if seen == 0:
        raise PlanError("select: data yielded no batches; pass at least one (x, y) batch.")
    return grads.take(keep=keep)


def _delta(model, variables, data, loss_fn, batch_size, limit, epochs, optimizer, verbose, prep):
    before = [np.array(to_numpy(v), copy=True) for v in model.variables]  # theta_0, the one copy this score keeps
    index = {id(v): i for i, v in enumerate(model.variables)}
    start = [before[index[id(v)]] for v in variables]
    opt = optimizer if optimizer is not None else keras.optimizers.Adam(1e-3)
    try:
        opt.build(variables)
        step = gradients.train_step(model, variables, loss_fn, opt)
        seen = 0
        for _ in range(epochs):
            it, total = _batches(data, batch_size, limit, prep)
            bar = keras.utils.Progbar(total, verbose=verbose, unit_name="batch")
            for i, (x, y) in enumerate(it):
                step(x, y)
                seen += 1
                bar.update(i + 1)
        if seen == 0:
            raise PlanError("select: data yielded no batches; pass at least one (x, y) batch.")
        out = []
        for k, v in enumerate(variables):
            d = np.asarray(to_numpy(v), np.float32).copy()
            np.subtract(d, start[k], out=d)
            out.append(np.abs(d, out=d))
        return out
    finally:
        for v, b in zip(model.variables, before):
            v.assign(b)
