"""Room of enforcement: what each variable gets and the object that gives it.

Owns: the capabilities of inner optimizers and the strategy policy (``policy``), the
immutable per-variable ``Layout`` (``layout``) and the ``Enforcer`` that
carries one entry out around the inner update, with its optimizer variables
(``enforcer``).

May import: the foundation (``_keras`` included), ``_backends``, ``_plan``, ``_resolve``, ``_slices``.
"""
