"""Training steps written once for every Keras backend (the backend is chosen by ``KERAS_BACKEND``).

``MODES`` are the execution modes of the backend in force: TensorFlow runs
eager, ``tf.function`` graphs and XLA; JAX runs eager and ``jax.jit`` over
the optimizer's ``stateless_apply`` (what Keras' JAX trainer does); PyTorch
runs eager.
"""

import keras
import numpy as np

BACKEND = keras.backend.backend()
MODES = {"tensorflow": ["eager", "graph", "xla"], "jax": ["eager", "jit"], "torch": ["eager"]}[BACKEND]
#: ``compile`` options of every way ``fit`` runs on the backend in force (PyTorch:
#: ``jit_compile`` is torch.compile, not run; ``steps_per_execution`` > 1 is refused by Keras).
FIT_MODES = {
    "tensorflow": [{"run_eagerly": True}, {}, {"jit_compile": True}, {"steps_per_execution": 4}],
    "jax": [{"run_eagerly": True}, {}, {"steps_per_execution": 4}],
    "torch": [{"run_eagerly": True}, {}],
}[BACKEND]
#: The mode Keras' trainer runs by default: a traced graph, a jitted step, PyTorch eager.
COMPILED = MODES[1] if len(MODES) > 1 else MODES[0]


def two_dense(name, inputs, hidden, outputs=2, names=("a", "b")):
    """``Input -> Dense(hidden) -> Dense(outputs)``, the same weights on every backend (numpy-seeded:
    ``keras.utils.set_random_seed`` would import TensorFlow where it is installed)."""
    m = keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(hidden, name=names[0]), keras.layers.Dense(outputs, name=names[1])],
        name=name,
    )
    rng = np.random.default_rng(0)
    m.set_weights([rng.normal(size=w.shape).astype("float32") for w in m.get_weights()])
    return m


def attention_model():
    """Self-attention over 6 tokens of width 4, averaged, into 4 classes (Keras' MultiHeadAttention)."""
    tokens = keras.Input((6, 4))
    h = keras.layers.MultiHeadAttention(2, 3, name="attention")(tokens, tokens)
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out, name="attn")


def gradients(loss_fn, variables):
    """Gradients of ``loss_fn()`` with respect to ``variables`` on the backend in force."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn()
        return tape.gradient(loss, variables)
    if BACKEND == "jax":
        import jax

        def pure(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn()

        return jax.grad(pure)([v.value for v in variables])
    for v in variables:
        v.value.grad = None
    loss_fn().backward()
    return [v.value.grad for v in variables]


def train_step(opt, variables, loss_fn, mode):
    """A function that runs one optimizer step on ``variables`` in ``mode``."""

    def step():
        opt.apply_gradients(zip(gradients(loss_fn, variables), variables))

    if mode == "eager":
        return step
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(step, jit_compile=(mode == "xla"))
    if BACKEND != "jax" or mode != "jit":
        raise ValueError(f"no mode {mode!r} on {BACKEND}; modes here: {MODES}")
    import jax

    opt.build(variables) if not opt.built else None

    @jax.jit
    def pure(trainable, optimizer):
        def loss_of(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn()

        return opt.stateless_apply(optimizer, jax.grad(loss_of)(trainable), trainable)

    def jitted():
        trainable, optimizer = pure([v.value for v in variables], [v.value for v in opt.variables])
        for v, value in zip(variables, trainable):
            v.assign(value)
        for v, value in zip(opt.variables, optimizer):
            v.assign(value)

    return jitted


def weights_of(obj) -> list:
    """``obj.weights`` without the stand-ins a Freezer's sliced layers hold (the model's own weights)."""
    from finefreeze._resolve.standins import held

    return [v for v in obj.weights if not held(v)]


def squares_gradients(frz, model, plain, x) -> tuple[dict, dict, list]:
    """The gradients of ``sum(model(x) ** 2)`` as :func:`as_kernel_gradients` has them, plain Keras' by path, and the raw ones.

    ``plain`` is the same model without a Freezer; the raw gradients are
    ``model.trainable_weights``' (stand-ins included), in that order.
    """
    import keras

    variables = list(model.trainable_weights)
    grads = gradients(lambda: keras.ops.sum(model(x) ** 2), variables)
    ref = gradients(lambda: keras.ops.sum(plain(x) ** 2), list(plain.trainable_weights))
    plain_by_path = {v.path: np.array(keras.ops.convert_to_numpy(g)) for v, g in zip(plain.trainable_weights, ref)}
    return as_kernel_gradients(frz, variables, grads), plain_by_path, list(zip(variables, grads))


def as_kernel_gradients(frz, variables, grads) -> dict:
    """``{path: gradient}`` of the model's own variables, as a training step has them.

    A sliced layer hands the gradient of a kernel's trained elements to its
    stand-in and none to the kernel: the stand-in's gradient is put back at
    those elements of a kernel-shaped array (zero elsewhere), the kernel's
    own (None, or JAX's zeros) is left out.
    """
    from finefreeze._resolve.standins import kernel_of

    out = {}
    for v, g in zip(variables, grads):
        kernel = kernel_of(v)
        if g is not None and type(g).__name__ == "IndexedSlices":
            import tensorflow as tf

            g = tf.convert_to_tensor(g)
        value = None if g is None else np.array(keras.ops.convert_to_numpy(g), copy=True)
        if kernel is None:
            out.setdefault(v.path, value)
            continue
        full = np.zeros(tuple(kernel.shape), value.dtype)
        full.reshape(-1)[np.flatnonzero(~frz.frozen_mask(kernel.path))] = value
        out[kernel.path] = full
    return out


def shares_its_buffer(variable) -> bool:
    """Whether two whole reads of ``variable`` are the same memory (not a copy each: copy-on-read mode).

    Each read's memory seen through DLPack (``numpy()`` would copy it).
    """
    import tensorflow as tf

    class Exported:
        def __init__(self, tensor):
            self.tensor = tensor

        def __dlpack__(self, **_):
            return tf.experimental.dlpack.to_dlpack(self.tensor)

        def __dlpack_device__(self):
            return (1, 0)  # the CPU

    raw = variable.value
    reads = [tf.raw_ops.ReadVariableOp(resource=raw.handle, dtype=raw.dtype) for _ in range(2)]
    a, b = (np.from_dlpack(Exported(r)).__array_interface__["data"][0] for r in reads)
    return a == b


def strategy_of(frz, path: str):
    """The strategy ``frz.report()`` names for a partially frozen variable (its path or the end of it), else None."""
    (v,) = [v for v in frz.report()["variables"] if v["path"] == path or v["path"].endswith("/" + path)]
    return v["strategy"] if v["state"] == "partial" else None
