"""Room of Freezers: the shared base, the Keras Freezer and the graph Freezer.

Owns: ``FreezerBase`` (plan, resolution, state queries, history, report,
summary, plot), ``Freezer`` (Keras flags, wrap, update, verify, deltas),
``GraphFreezer`` (``tf.compat.v1`` graphs), keeping Keras' own flags
meaningful (``keras_flags``) and resuming: a checkpoint's masks in force and
the Freezer of a loaded model (``reload``).

May import: every room below it (``_keras``, ``_backends``, ``_plan``,
``_resolve``, ``_slices``, ``_enforce``, ``_optimizer``, ``_report``,
``_files``, ``_tf1``).
"""
