"""Gradients for the data scores of :func:`finefreeze.select`, per Keras backend.

:mod:`finefreeze._select.scores` streams the batches, cuts them into microbatches,
hands the scores over and restores the model after ``delta``, once for every
backend. What differs between backends is only how a gradient is taken, and
that lives in one module per backend (``tensorflow``, ``jax``, ``torch``, sharing
``accumulate``): :func:`make` gives an object whose ``add("gradient", x, y)``
adds |gradient of the batch loss| and ``add("fisher", x, y)`` adds the sum of
squared per-example gradients into one float32 accumulator per scored
element, inside the backend's compiled step; :func:`train_step` gives one
plain training step for ``delta``.

- TensorFlow: ``tf.GradientTape``; per-example gradients with
  ``tf.vectorized_map`` (``per_example="vectorized"``), or one example after
  the other in ``tf.map_fn`` (``"loop"``, chosen by ``"auto"`` for models with
  a ``MultiHeadAttention`` or ``Softmax`` layer, KerasHub's attention
  included: TensorFlow 2.21 aborts the process, heap corruption, when it
  vectorises that gradient; and by ``"auto"`` from the first microbatch
  whose vectorised gradient TensorFlow refuses with an error); ``tf.function`` steps that
  ``assign_add`` into ``tf.Variable`` accumulators.
- JAX: the loss as a pure function of the variables' values. The model is
  called under ``keras.StatelessScope`` with every model variable mapped to
  a value passed in, as ``Layer.stateless_call`` does (without its rule that
  the values line up with ``model.trainable_variables``, which a Freezer
  changes). Per-example gradients are ``jax.vmap(jax.grad(...))`` (``"loop"``:
  a ``jax.lax.scan`` over the examples that carries the sums, one gradient at
  a time). Each step is ``jax.jit``-ed once (JAX compiles once per input
  shape) and adds into accumulators it is donated, so no second copy of them
  is made. On a CPU the loop is much faster for ``Dense`` kernels (XLA
  reduces a batch of outer products slowly) and much slower for
  convolutions; ``"auto"`` is ``vmap``.
- PyTorch: the same pure function under ``torch.func``: per-example
  gradients are ``torch.func.vmap(torch.func.grad(...))``, not a loop of
  ``loss.backward()``: Keras' torch layers are torch ops on the values the
  scope hands them, so the transforms go through them, and ``vmap`` is the
  faster where it works (2x on the digits MLP, 5x on a small transformer).
  Checked against a loop of single-example gradients: Dense, Conv2D,
  pooling, BatchNormalization, LayerNormalization, Embedding,
  MultiHeadAttention (PyTorch falls back to an unbatched CPU attention
  kernel, with a performance warning), LSTM, GRU. Some ops ``vmap`` cannot
  batch (``.item()``; a Conv2D backward that PyTorch runs channels-last):
  it raises, and ``"auto"`` then takes the examples one after the other with
  ``torch.func.grad`` (``"loop"``) for the rest of the run, while
  ``"vectorized"`` is a ``PlanError``. Accumulators are float32 tensors on
  the variables' device, added in place.

A microbatch of ``m`` examples holds ``m`` per-example gradients at most
(``"loop"``: one). TensorFlow is imported only when it is the Keras backend.
"""

from __future__ import annotations

import importlib

import keras

from finefreeze._backends.chosen import chosen
from finefreeze._errors import PlanError
from finefreeze._keras.layers import all_layers

__all__ = ["make", "train_step", "need_gradients"]

BACKENDS = ("tensorflow", "jax", "torch")


def need_gradients(score: str) -> None:
    """Raise unless the Keras backend in force can take gradients here.

    Raises:
        PlanError: a backend other than TensorFlow, JAX and PyTorch.
    """
    b = keras.backend.backend()
    if b not in BACKENDS:
        raise PlanError(
            f"select: score {score!r} takes gradients, which finefreeze computes on the TensorFlow, JAX and "
            f"PyTorch backends (the backend is {b!r}); set KERAS_BACKEND to one of them, or use "
            "score='magnitude' or 'random'."
        )


def _no_pfor_layers():
    # TensorFlow 2.21's vectorised gradient of a batched softmax fails ("Input dims must be <= 5") and then
    # corrupts the heap: the process aborts, nothing to catch. MultiHeadAttention and KerasHub's attention
    # layers (Gemma, Llama, GPT-2, BERT) compute theirs with a Softmax layer.
    return (keras.layers.MultiHeadAttention, keras.layers.Softmax)


def per_example_mode(model, mode: str) -> str:
    """``"vectorized"`` or ``"loop"``; ``"auto"`` stays ``"auto"`` on PyTorch and TensorFlow: vectorised, then the loop if that fails.

    Raises:
        PlanError: an unknown mode; ``"vectorized"`` on TensorFlow for a model with a softmax layer.
    """
    if mode not in ("auto", "vectorized", "loop"):
        raise PlanError(f"select: per_example={mode!r}; choose 'auto', 'vectorized' or 'loop'.")
    b = keras.backend.backend()
    layers = all_layers(model) if isinstance(model, keras.Layer) else []
    softmax = next((x for x in layers if isinstance(x, _no_pfor_layers())), None)
    if mode == "vectorized" and b == "tensorflow" and softmax is not None:
        raise PlanError(
            f"select: per_example='vectorized' on TensorFlow cannot take the per-example gradients of layer "
            f"{softmax.name!r} ({type(softmax).__name__}): TensorFlow's vectorised softmax gradient aborts the "
            "process; use per_example='auto' or 'loop' (one example after the other)."
        )
    if mode != "auto":
        return mode
    if b == "torch":
        return "auto"
    if b == "tensorflow":  # auto: vectorized, then the loop if pfor refuses a model's op
        return "loop" if softmax is not None else "auto"
    return "vectorized"


def _backend_class():
    """The ``Gradients`` class of the Keras backend in force (its module imports only that framework)."""
    module = chosen().__name__
    if module.endswith("functional"):
        raise PlanError(
            f"select takes gradients, which the Keras backend {keras.backend.backend()!r} does not compute; "
            "run it on TensorFlow, JAX or PyTorch (KERAS_BACKEND=jax)."
        )
    return importlib.import_module(f"{module}.gradients").Gradients


def make(model, variables, loss_fn, per_example: str = "auto"):
    """Accumulating gradients of ``loss_fn(y, model(x))`` w.r.t. ``variables`` on the backend in force."""
    return _backend_class()(model, list(variables), loss_fn, per_example_mode(model, per_example))


def train_step(model, variables, loss_fn, optimizer):
    """A callable ``(x, y)`` that takes one training step (``training=True``) of ``variables`` with ``optimizer``."""
    return _backend_class().train_step(model, list(variables), loss_fn, optimizer)
