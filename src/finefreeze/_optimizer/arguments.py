"""What ``FreezingOptimizer`` refuses at construction, as Keras' ``LossScaleOptimizer`` does.

Optimizer settings belong to the inner optimizer; it must be an unbuilt
Keras optimizer that is neither another ``FreezingOptimizer`` nor a
``LossScaleOptimizer``; the strategy and the plan must be known kinds.
"""

from __future__ import annotations

import inspect

import keras
from keras.src.optimizers.base_optimizer import BaseOptimizer

from finefreeze._errors import PlanError
from finefreeze._kinds import STRATEGIES
from finefreeze._plan.plan import Plan

__all__ = ["refuse_arguments"]


def refuse_arguments(wrapper: type, inner_optimizer, plan, strategy: str, kwargs: dict) -> None:
    """Raise unless ``wrapper(inner_optimizer, plan, strategy=strategy, **kwargs)`` is well formed.

    ``wrapper`` is the ``FreezingOptimizer`` class (it may not wrap itself).

    Raises:
        TypeError: a setting or unknown argument, or an inner optimizer of the wrong kind.
        ValueError: the inner optimizer is already built.
        PlanError: unknown strategy, or ``plan`` is not a Plan.
    """
    if kwargs:
        settings = set(inspect.signature(BaseOptimizer.__init__).parameters)
        unknown = sorted(k for k in kwargs if k not in settings)
        if unknown:
            raise TypeError(
                f"FreezingOptimizer got unknown argument(s) {', '.join(unknown)}; it takes "
                "(inner_optimizer, plan=None, *, strategy='auto', name=None)."
            )
        names = ", ".join(sorted(kwargs))
        example = ", ".join(f"{k}=..." for k in sorted(kwargs))
        cls = type(inner_optimizer).__name__ if isinstance(inner_optimizer, keras.optimizers.Optimizer) else "Adam"
        raise TypeError(
            f"FreezingOptimizer takes no optimizer settings (got {names}); they belong to the inner "
            f"optimizer: ff.FreezingOptimizer(keras.optimizers.{cls}(..., {example}), plan) or "
            f"frz.wrap(keras.optimizers.{cls}(..., {example}))."
        )
    if isinstance(inner_optimizer, wrapper):
        raise TypeError(
            "FreezingOptimizer cannot wrap another FreezingOptimizer: one plan per optimizer. "
            "Put every rule in one plan, or wrap the plain optimizer."
        )
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "FreezingOptimizer cannot wrap a LossScaleOptimizer: the loss scale "
            "optimizer must stay outermost. Wrap the plain optimizer; under "
            "mixed_float16, model.compile adds the LossScaleOptimizer around "
            "the FreezingOptimizer itself (or wrap it yourself: "
            "LossScaleOptimizer(FreezingOptimizer(Adam(), plan)))."
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"inner_optimizer must be a keras.optimizers.Optimizer, got {type(inner_optimizer).__name__}.")
    if inner_optimizer.built:
        raise ValueError(
            f"the {type(inner_optimizer).__name__} to wrap is already built on "
            f"{len(inner_optimizer._trainable_variables)} variables; wrap a new, unbuilt optimizer."
        )
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"plan must be an ff.Plan, got {type(plan).__name__}.")
