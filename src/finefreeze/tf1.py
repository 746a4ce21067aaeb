"""``tf.compat.v1`` graph code: :class:`Freezer` over a graph's variables, with an exact train op.

``ff.tf1.Freezer(graph, plan)`` resolves a plan against a ``tf.Graph`` (its
``TRAINABLE_VARIABLES`` collection), graph variables or a ``tf.Module``
built in a graph; ``frz.var_list`` is what an optimizer updates at all and
``frz.minimize(optimizer, loss)`` builds a train op that keeps the frozen
elements bit-identical with every ``tf.compat.v1.train`` optimizer
(docs/tf1.md). Importing this module imports TensorFlow.

Example:
    >>> import tensorflow as tf, finefreeze as ff
    >>> with tf.Graph().as_default() as g:
    ...     w = tf.compat.v1.get_variable("w", initializer=tf.zeros((2, 2)))
    ...     frz = ff.tf1.Freezer(g, ff.Plan([ff.freeze("w[0]")]))
    >>> frz.variable_state("w")
    'partial'
"""

try:
    import tensorflow  # noqa: F401  (graph code is TensorFlow's)
except ImportError as e:
    raise ImportError(
        "ff.tf1 freezes tf.compat.v1 graph code and needs TensorFlow: pip install 'finefreeze[tensorflow]'"
    ) from e

from finefreeze._freezer.graph import Freezer as Freezer  # noqa: E402

__all__ = ["Freezer"]
