"""Per-element scores for :func:`finefreeze.select`, reduced as batches stream.

Every score keeps at most one float32 accumulator per scored element (a
``tf.Variable`` of the variable's shape) and adds each batch into it; no
batch's scores are kept. Per-example gradients (``fisher``) come from
``tf.vectorized_map`` over microbatches, so a microbatch of ``m`` examples
holds ``m`` gradients for a moment. TensorFlow 2.21 aborts the process
(heap corruption) when it vectorises the gradient of Keras'
``MultiHeadAttention``; models with one take the examples one after the
other in a ``tf.map_fn`` loop instead (``per_example="loop"``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import keras
import numpy as np

from finefreeze._errors import PlanError

__all__ = ["SCORES", "batches", "loss_function", "stream_scores", "static_score"]

SCORES = ("fisher", "gradient", "magnitude", "delta", "random")
DATA_SCORES = ("fisher", "gradient", "delta")


class _TensorFlow:
    """``tensorflow``, imported on first use: the data scores need it, the others and the JAX backend do not."""

    def __getattr__(self, name):
        import tensorflow

        return getattr(tensorflow, name)


tf = _TensorFlow()


def need_tensorflow(score: str) -> None:
    """Raise unless the data score ``score`` can run on the Keras backend in force.

    Raises:
        PlanError: on JAX or PyTorch (per-example gradients use ``tf.vectorized_map``).
    """
    if keras.backend.backend() != "tensorflow":
        raise PlanError(
            f"select: score {score!r} computes gradients with TensorFlow and needs KERAS_BACKEND=tensorflow "
            f"(the backend is {keras.backend.backend()!r}); 'magnitude' and 'random' run on every backend."
        )


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
    if isinstance(data, tuple) and len(data) in (2, 3) and not isinstance(data[0], tuple):
        x, y = data[0], data[1]
        n = len(y)
        first = tf.nest.flatten(x)
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
                yield tf.nest.map_structure(lambda t, s=s: t[s], x), y[s]

        return gen(), total
    if not hasattr(data, "__iter__"):
        raise PlanError(
            f"select: data must be (x, y) arrays, a tf.data.Dataset or an iterable of (x, y) batches; "
            f"got {type(data).__name__}."
        )
    total = None
    if isinstance(data, tf.data.Dataset):
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


def loss_function(model, loss):
    """A callable ``(y_true, y_pred) -> scalar`` from ``loss=`` or the model's compiled loss.

    Raises:
        PlanError: no usable loss.
    """
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
        return tf.reduce_mean(tf.cast(fn(y, p), tf.float32))

    return scalar


def static_score(name: str, value: np.ndarray, *, largest: bool, rng: np.random.Generator) -> np.ndarray:
    """Score without data: ``magnitude`` (|w|, or -|w| for the smallest) or ``random``."""
    if name == "magnitude":
        a = np.abs(value.astype(np.float32, copy=False))
        return a if largest else np.negative(a, out=a)
    return rng.random(value.shape, dtype=np.float32)


def per_example_mode(model, mode: str) -> str:
    """``"vectorized"`` or ``"loop"``: ``"auto"`` loops for models that ``vectorized_map`` crashes on.

    Raises:
        PlanError: an unknown mode.
    """
    if mode not in ("auto", "vectorized", "loop"):
        raise PlanError(f"select: per_example={mode!r}; choose 'auto', 'vectorized' or 'loop'.")
    if mode != "auto":
        return mode
    layers = model._flatten_layers(include_self=True) if isinstance(model, keras.Layer) else []
    return "loop" if any(isinstance(x, _NO_PFOR) for x in layers) else "vectorized"


_NO_PFOR = (keras.layers.MultiHeadAttention,)


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
    accumulators and traced steps are kept there and reused, not released.
    """
    if cache:
        for a in cache["accs"]:
            a.assign(tf.zeros_like(a))
        return _stream(
            cache["accs"],
            [cache["gradient_step"], cache["fisher_step"]],
            data,
            score,
            batch_size,
            limit,
            microbatch,
            verbose,
            keep=True,
        )
    loss_fn = loss_function(model, loss)
    watched = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    if score == "delta":
        return _delta(model, variables, watched, data, loss_fn, batch_size, limit, epochs, optimizer, verbose)
    mode = per_example_mode(model, per_example)
    accs = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in variables]

    def grads(x, y):
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(watched)
            out = loss_fn(y, model(x, training=False))
        return [
            tf.zeros(w.shape, tf.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
            for g, w in zip(tape.gradient(out, watched), watched)  # embeddings: IndexedSlices made dense
        ]

    @tf.function(reduce_retracing=True)
    def gradient_step(x, y):
        for a, g in zip(accs, grads(x, y)):
            a.assign_add(tf.abs(g))

    @tf.function(reduce_retracing=True)
    def fisher_step(x, y):
        def one(xy):
            xi, yi = xy
            return [tf.square(g) for g in grads(tf.nest.map_structure(lambda t: t[None], xi), yi[None])]

        if mode == "loop":
            spec = [tf.TensorSpec(w.shape, tf.float32) for w in watched]
            squares = tf.map_fn(one, (x, y), fn_output_signature=spec)
        else:
            squares = tf.vectorized_map(one, (x, y), fallback_to_while_loop=True)
        for a, sq in zip(accs, squares):
            a.assign_add(tf.reduce_sum(sq, axis=0))

    steps = [gradient_step, fisher_step]
    del gradient_step, fisher_step  # only ``steps`` holds them, so _stream can release them
    if cache is not None:
        cache.update(accs=accs, gradient_step=steps[0], fisher_step=steps[1])
    return _stream(accs, steps, data, score, batch_size, limit, microbatch, verbose, keep=cache is not None)


def _stream(accs, steps, data, score, batch_size, limit, microbatch, verbose, *, keep):
    gradient_step, fisher_step = steps
    it, total = batches(data, batch_size=batch_size, limit=limit)
    bar = keras.utils.Progbar(total, verbose=verbose, unit_name="batch")
    seen = 0
    for i, (x, y) in enumerate(it):
        if score == "gradient":
            gradient_step(x, y)
        else:
            n = len(y)
            for s in range(0, n, microbatch):
                sl = slice(s, s + microbatch)
                fisher_step(tf.nest.map_structure(lambda t, sl=sl: t[sl], x), y[sl])
        seen += 1
        bar.update(i + 1)
    if seen == 0:
        raise PlanError("select: data yielded no batches; pass at least one (x, y) batch.")
    if keep:
        return [a.numpy() for a in accs]
    del gradient_step, fisher_step
    steps.clear()  # their graphs hold the accumulators
    gc.collect()
    out = []
    for j in range(len(accs)):  # hand over one variable at a time: never two full copies
        out.append(accs[j].numpy())
        accs[j] = None
    return out


def _delta(model, variables, watched, data, loss_fn, batch_size, limit, epochs, optimizer, verbose):
    before = [np.array(v.numpy(), copy=True) for v in model.variables]  # theta_0, the one copy this score keeps
    index = {id(v): i for i, v in enumerate(model.variables)}
    start = [before[index[id(v)]] for v in variables]
    opt = optimizer if optimizer is not None else keras.optimizers.Adam(1e-3)
    try:
        opt.build(variables)

        @tf.function(reduce_retracing=True)
        def step(x, y):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                out = loss_fn(y, model(x, training=True))
            g = tape.gradient(out, watched)
            opt.apply([tf.zeros_like(w) if gi is None else gi for gi, w in zip(g, watched)], variables)

        seen = 0
        for _ in range(epochs):
            it, total = batches(data, batch_size=batch_size, limit=limit)
            bar = keras.utils.Progbar(total, verbose=verbose, unit_name="batch")
            for i, (x, y) in enumerate(it):
                step(x, y)
                seen += 1
                bar.update(i + 1)
        if seen == 0:
            raise PlanError("select: data yielded no batches; pass at least one (x, y) batch.")
        out = []
        for k, v in enumerate(variables):
            d = np.asarray(v.numpy(), np.float32)
            np.subtract(d, start[k], out=d)
            out.append(np.abs(d, out=d))
        return out
    finally:
        for v, b in zip(model.variables, before):
            v.assign(b)
