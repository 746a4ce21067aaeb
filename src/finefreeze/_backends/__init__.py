"""Room of the Keras backends: every TensorFlow, JAX and PyTorch specific of the package.

Owns: the named questions about the environment (``questions``: is the Keras
backend TensorFlow, is TensorFlow imported, is it installed), the variable
operations that differ per backend (``variables``, ``arrays``), ``tf.distribute`` facts
(``distribute``), fast reads (``read``) and the per-backend per-example
gradients of ``select`` (``gradients`` with ``tensorflow``, ``jax``,
``torch``, sharing ``accumulate``).

May import: ``finefreeze._errors`` and the frameworks. Nothing else of finefreeze.
"""
