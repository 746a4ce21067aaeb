"""Training steps written once for every Keras backend (the backend is chosen by ``KERAS_BACKEND``).

``MODES`` are the execution modes of the backend in force: TensorFlow runs
eager, ``tf.function`` graphs and XLA; JAX runs eager and ``jax.jit`` over
the optimizer's ``stateless_apply`` (what Keras' JAX trainer does); PyTorch
runs eager.
"""

import keras

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
