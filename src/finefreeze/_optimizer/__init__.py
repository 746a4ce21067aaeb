"""Room of the optimizer: ``FreezingOptimizer``, plan changes, state migration.

Owns: the Keras wrapper (``wrapper``: delegation, ``build``, ``apply``,
config), the one owner of its enforcement state (``enforcement``: the
enforcers, layout, resolution, step counts and the inner build; install,
change in place, rebuild, begin / undo), carrying inner optimizer state
across a change (``migrate``), the step counts of released elements
(``ages``), whether the plan is in force (``in_force``), the checkpoint
record (``checkpoint``) and the gradient norms FreezeBoard reads (``norms``).
What it needs of a Freezer arrives as arguments (``freezer`` is passed in,
never looked up inside ``ages``, ``in_force`` or ``checkpoint``).

May import: the foundation (``_keras`` included), ``_backends``, ``_plan``,
``_resolve``, ``_slices``, ``_enforce``.
"""
