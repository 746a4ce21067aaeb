"""Room of the optimizer: ``FreezingOptimizer``, plan changes, state migration.

Owns: the Keras wrapper (``wrapper``: delegation, ``build``, ``apply``,
config), the plan-change transaction (``change``), carrying inner optimizer
state across a change (``migrate``) and the gradient norms FreezeBoard reads
(``norms``).

May import: ``finefreeze._errors``, ``_backends``, ``_plan``, ``_resolve``, ``_enforce``.

``FreezingOptimizer`` is re-exported here: model files of release 0.1 name
``finefreeze._optimizer`` as its module. Keras 3.15 finds the class by its
registered name (``finefreeze>FreezingOptimizer``, registered on
``import finefreeze``); the path stays importable for whatever reads it.
"""

from finefreeze._optimizer.wrapper import FreezingOptimizer as FreezingOptimizer

__all__ = ["FreezingOptimizer"]
