"""Room of the Keras backends: every TensorFlow, JAX and PyTorch specific of the package.

Owns: one module per backend (``tensorflow``, ``jax``, ``torch``), each
implementing the interface ``functional`` documents (reads, sparse
gradients, in-place writes, the tap of a sliced kernel, per-example
gradients in its ``gradients``), chosen once (``chosen``); the operations
the strategies call, written once over the chosen module (``variables``,
``elements``, ``arrays``); the named questions about the environment
(``questions``), what each backend measured (``costs``), ``tf.distribute``
facts (``distribute``), fast reads (``read``) and the shared pieces of
``select``'s per-example gradients (``gradients``, ``accumulate``).

May import: the foundation (``_errors``, ``_keras``) and the frameworks. Nothing else of finefreeze.
"""
