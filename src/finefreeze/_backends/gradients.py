"""Gradients for the data scores of :func:`finefreeze.select`, per Keras backend.

:mod:`finefreeze._select.scores` streams the batches, cuts them into microbatches,
hands the scores over and restores the model after ``delta``, once for every
backend. What differs between backends is only how a gradient is taken, and
that lives here: :func:`make` gives an object whose ``add("gradient", x, y)``
adds |gradient of the batch loss| and ``add("fisher", x, y)`` adds the sum of
squared per-example gradients into one float32 accumulator per scored
element, inside the backend's compiled step; :func:`train_step` gives one
plain training step for ``delta``.

- TensorFlow: ``tf.GradientTape``; per-example gradients with
  ``tf.vectorized_map`` (``per_example="vectorized"``), or one example after
  the other in ``tf.map_fn`` (``"loop"``, chosen by ``"auto"`` for models with
  a ``MultiHeadAttention`` layer: TensorFlow 2.21 aborts the process, heap
  corruption, when it vectorises that gradient); ``tf.function`` steps that
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

import gc
import warnings

import keras
import numpy as np

from finefreeze._errors import PlanError

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
    return (keras.layers.MultiHeadAttention,)


def per_example_mode(model, mode: str) -> str:
    """``"vectorized"`` or ``"loop"`` (``"auto"`` stays ``"auto"`` on PyTorch: vmap, then the loop if it fails).

    Raises:
        PlanError: an unknown mode.
    """
    if mode not in ("auto", "vectorized", "loop"):
        raise PlanError(f"select: per_example={mode!r}; choose 'auto', 'vectorized' or 'loop'.")
    if mode != "auto":
        return mode
    b = keras.backend.backend()
    if b == "torch":
        return "auto"
    if b == "tensorflow":
        layers = model._flatten_layers(include_self=True) if isinstance(model, keras.Layer) else []
        return "loop" if any(isinstance(x, _no_pfor_layers()) for x in layers) else "vectorized"
    return "vectorized"


def make(model, variables, loss_fn, per_example: str = "auto"):
    """Accumulating gradients of ``loss_fn(y, model(x))`` w.r.t. ``variables`` on the backend in force."""
    cls = {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[keras.backend.backend()]
    return cls(model, list(variables), loss_fn, per_example_mode(model, per_example))


def train_step(model, variables, loss_fn, optimizer):
    """A callable ``(x, y)`` that takes one training step (``training=True``) of ``variables`` with ``optimizer``."""
    cls = {"tensorflow": _TensorFlow, "jax": _Jax, "torch": _Torch}[keras.backend.backend()]
    return cls.train_step(model, list(variables), loss_fn, optimizer)


class _Grads:
    """Shared: accumulators, reset, the hand-over as numpy arrays one variable at a time."""

    accs: list

    def add(self, kind: str, x, y) -> None:
        self._steps[kind](*self._inputs(x, y))

    def _inputs(self, x, y):
        return x, y

    def reset(self) -> None:
        self.accs[:] = [self._zeros(a) for a in self.accs]

    def take(self, *, keep: bool) -> list[np.ndarray]:
        """The accumulators as float32 numpy arrays; without ``keep`` they are released one at a time."""
        if keep:
            return [self._numpy(a, copy=True) for a in self.accs]
        self._steps.clear()  # compiled steps may hold the accumulators
        gc.collect()
        out = []
        for j in range(len(self.accs)):  # never two full copies
            out.append(self._numpy(self.accs[j], copy=False))
            self.accs[j] = None
        return out


def _others(model, variables):
    ids = {id(v) for v in variables}
    return [v for v in model.variables if id(v) not in ids]


def _pure_loss(model, variables, others, loss_fn):
    """``f(values, other_values, x, y, training) -> (loss, new other_values)`` with no side effect on the model."""

    def f(values, other_values, x, y, training):
        mapping = list(zip(variables, values)) + list(zip(others, other_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            loss = loss_fn(y, model(x, training=training))
        new = [scope.get_current_value(v) for v in others]
        return loss, [o if n is None else n for o, n in zip(other_values, new)]

    return f


def _one(tree):
    """An example as a batch of one."""
    return keras.tree.map_structure(lambda t: t[None], tree)


def _as_arrays(tree):
    """Leaves that are not tensors of the backend in force (tf.data batches) as numpy arrays."""
    return keras.tree.map_structure(lambda t: t if keras.ops.is_tensor(t) else np.asarray(t), tree)


class _TensorFlow(_Grads):
    def __init__(self, model, variables, loss_fn, mode):
        import tensorflow as tf

        watched = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        accs = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in variables]
        self.accs = accs

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
                return [tf.square(g) for g in grads(_one(xi), _one(yi))]

            if mode == "loop":
                spec = [tf.TensorSpec(w.shape, tf.float32) for w in watched]
                squares = tf.map_fn(one, (x, y), fn_output_signature=spec)
            else:
                squares = tf.vectorized_map(one, (x, y), fallback_to_while_loop=True)
            for a, sq in zip(accs, squares):
                a.assign_add(tf.reduce_sum(sq, axis=0))

        self._steps = {"gradient": gradient_step, "fisher": fisher_step}

    def reset(self):
        for a in self.accs:
            a.assign(np.zeros(a.shape, np.float32))

    @staticmethod
    def _numpy(a, copy):
        return a.numpy()  # always a copy

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        import tensorflow as tf

        watched = [v.value if isinstance(v, keras.Variable) else v for v in variables]

        @tf.function(reduce_retracing=True)
        def step(x, y):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                out = loss_fn(y, model(x, training=True))
            g = tape.gradient(out, watched)
            optimizer.apply([tf.zeros_like(w) if gi is None else gi for gi, w in zip(g, watched)], variables)

        return step


class _Jax(_Grads):
    def __init__(self, model, variables, loss_fn, mode):
        import jax
        import jax.numpy as jnp

        others = _others(model, variables)
        f = _pure_loss(model, variables, others, loss_fn)
        self.variables, self.others = variables, others
        self.accs = [jnp.zeros(v.shape, jnp.float32) for v in variables]

        def batch_grads(values, ovals, x, y):
            return jax.grad(lambda v: f(v, ovals, x, y, False)[0])(values)

        def example_grads(values, ovals, xi, yi):
            return batch_grads(values, ovals, _one(xi), _one(yi))

        def gradient_step(accs, values, ovals, x, y):
            return [a + jnp.abs(g.astype(jnp.float32)) for a, g in zip(accs, batch_grads(values, ovals, x, y))]

        def fisher_step(accs, values, ovals, x, y):
            if mode == "loop":

                def body(acc, xy):
                    g = example_grads(values, ovals, *xy)
                    return [a + jnp.square(gi.astype(jnp.float32)) for a, gi in zip(acc, g)], None

                return jax.lax.scan(body, accs, (x, y))[0]
            g = jax.vmap(example_grads, in_axes=(None, None, 0, 0))(values, ovals, x, y)
            return [a + jnp.sum(jnp.square(gi.astype(jnp.float32)), axis=0) for a, gi in zip(accs, g)]

        jitted = {
            "gradient": jax.jit(gradient_step, donate_argnums=0),
            "fisher": jax.jit(fisher_step, donate_argnums=0),
        }

        def run(kind):
            def go(x, y):
                values = [v.value for v in self.variables]
                ovals = [v.value for v in self.others]
                self.accs[:] = jitted[kind](list(self.accs), values, ovals, x, y)

            return go

        self._steps = {"gradient": run("gradient"), "fisher": run("fisher")}

    def _inputs(self, x, y):
        return _as_arrays(x), _as_arrays(y)

    @staticmethod
    def _zeros(a):
        import jax.numpy as jnp

        return jnp.zeros(a.shape, jnp.float32)

    @staticmethod
    def _numpy(a, copy):
        return np.array(a, np.float32, copy=True)  # np.asarray of a jax array is read-only

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        import jax

        others = _others(model, variables)
        f = _pure_loss(model, variables, others, loss_fn)
        grads = jax.jit(lambda values, ovals, x, y: jax.grad(lambda v: f(v, ovals, x, y, True), has_aux=True)(values))

        def step(x, y):
            g, new = grads([v.value for v in variables], [v.value for v in others], _as_arrays(x), _as_arrays(y))
            for v, n in zip(others, new):  # state the call changed (seeds, BatchNormalization statistics)
                v.assign(n)
            optimizer.apply(g, variables)

        return step


class _Torch(_Grads):
    def __init__(self, model, variables, loss_fn, mode):
        import torch
        from torch.func import grad, vmap

        others = _others(model, variables)
        f = _pure_loss(model, variables, others, loss_fn)
        self.variables, self.others, self.mode = variables, others, mode
        self.accs = [torch.zeros(tuple(v.shape), dtype=torch.float32, device=v.value.device) for v in variables]
        batch_grads = grad(lambda values, ovals, x, y: f(values, ovals, x, y, False)[0])

        def example_grads(values, ovals, xi, yi):
            return batch_grads(values, ovals, _one(xi), _one(yi))

        vectorized = vmap(example_grads, in_dims=(None, None, 0, 0))

        def gradient_step(x, y):
            g = batch_grads(*self._values(), x, y)
            with torch.no_grad():
                for a, gi in zip(self.accs, g):
                    a.add_(gi.to(torch.float32).abs())

        def fisher_step(x, y):
            values, ovals = self._values()
            if self.mode != "loop":
                try:
                    with warnings.catch_warnings():
                        # "There is a performance drop because we have not yet implemented the batching
                        # rule for ...": PyTorch falls back to a loop inside vmap; the result is the same.
                        warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
                        squares = [gi.to(torch.float32).square().sum(0) for gi in vectorized(values, ovals, x, y)]
                except RuntimeError as e:
                    if self.mode == "vectorized":
                        said = next((ln.strip() for ln in str(e).splitlines() if "vmap" in ln), str(e))[:200]
                        raise PlanError(
                            f"select: per_example='vectorized': torch.func.vmap cannot batch this model's gradient "
                            f"({said}); use per_example='auto' or 'loop' (one example at a time)."
                        ) from None
                    self.mode = "loop"  # an op vmap cannot batch: one example at a time from now on
                else:
                    with torch.no_grad():
                        for a, sq in zip(self.accs, squares):
                            a.add_(sq)
                    return
            n = len(keras.tree.flatten(y)[0])
            for i in range(n):
                pick = lambda t, i=i: t[i]  # noqa: E731
                g = example_grads(values, ovals, keras.tree.map_structure(pick, x), keras.tree.map_structure(pick, y))
                with torch.no_grad():
                    for a, gi in zip(self.accs, g):
                        a.add_(gi.to(torch.float32).square())

        self._steps = {"gradient": gradient_step, "fisher": fisher_step}

    def _values(self):
        return [v.value.detach() for v in self.variables], [v.value.detach() for v in self.others]

    def _inputs(self, x, y):
        return _tensors(x), _tensors(y)

    @staticmethod
    def _zeros(a):
        return a.zero_()

    @staticmethod
    def _numpy(a, copy):
        out = a.detach().cpu().numpy()
        return out.copy() if copy else out

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        import torch
        from torch.func import grad

        others = _others(model, variables)
        f = _pure_loss(model, variables, others, loss_fn)
        grads = grad(lambda values, ovals, x, y: f(values, ovals, x, y, True), has_aux=True)

        def step(x, y):
            values = [v.value.detach() for v in variables]
            g, new = grads(values, [v.value.detach() for v in others], _tensors(x), _tensors(y))
            with torch.no_grad():
                for v, n in zip(others, new):  # state the call changed (seeds, BatchNormalization statistics)
                    v.assign(n)
                optimizer.apply(g, variables)

        return step


def _tensors(tree):
    return keras.tree.map_structure(keras.ops.convert_to_tensor, _as_arrays(tree))
