"""Room of ``tf.compat.v1`` graphs: graph variables as a target, the exact train op.

Imports TensorFlow at module level: only ``_freezer`` imports it, once
TensorFlow is imported and a graph target is seen.

May import: ``finefreeze._errors``, ``_backends``, ``_plan``, ``_resolve``.
"""
