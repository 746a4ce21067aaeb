"""What ``FreezingOptimizer`` refuses at construction, as Keras' ``LossScaleOptimizer`` does.

Optimizer settings belong to the inner optimizer; it must be an unbuilt
Keras optimizer that is neither another ``FreezingOptimizer`` nor a
``LossScaleOptimizer``; the strategy and the plan must be known kinds.
"""

from __future__ import annotations

import keras

from finefreeze._errors import PlanError
from finefreeze._keras.optimizers import base_settings, built_on
from finefreeze._kinds import STRATEGIES
from finefreeze._plan.plan import Plan

__all__ = ["CONSTRUCTOR_ONLY", "FORWARDED", "SettingsGoInside", "refuse_arguments", "refuse_late_setting"]

#: settings the inner optimizer reads at every step: assigned on the wrapper, they go to the inner optimizer
FORWARDED = ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "loss_scale_factor")
#: settings an optimizer acts on when it is built (state, accumulators): the inner optimizer's constructor takes them
CONSTRUCTOR_ONLY = (
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "gradient_accumulation_steps",
    "loss_scale_factor",
)


def refuse_late_setting(inner_optimizer, name: str, value) -> None:
    """Raise for a setting assigned on the wrapper that only the inner optimizer's constructor can take.

    Raises:
        TypeError: always; the message says where the setting goes.
    """
    cls = type(inner_optimizer).__name__
    raise TypeError(
        f"FreezingOptimizer.{name} = {value!r}: {name} belongs to the inner optimizer and acts when it is "
        f"built, so it cannot change afterwards; give it to the inner optimizer's constructor: "
        f"frz.wrap(keras.optimizers.{cls}(..., {name}={value!r}))."
    )


def refuse_arguments(wrapper: type, inner_optimizer, plan, strategy: str, kwargs: dict, step_count="release") -> None:
    """Raise unless ``wrapper(inner_optimizer, plan, strategy=strategy, **kwargs)`` is well formed.

    ``wrapper`` is the ``FreezingOptimizer`` class (it may not wrap itself).

    Raises:
        TypeError: a setting or unknown argument, or an inner optimizer of the wrong kind.
        ValueError: the inner optimizer is already built.
        PlanError: unknown strategy or step count, or ``plan`` is not a Plan.
    """
    if kwargs:
        settings = base_settings()
        unknown = sorted(k for k in kwargs if k not in settings)
        if unknown:
            raise TypeError(
                f"FreezingOptimizer got unknown argument(s) {', '.join(unknown)}; it takes "
                "(inner_optimizer, plan=None, *, strategy='auto', step_count='release', name=None)."
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
            f"{len(built_on(inner_optimizer))} variables; wrap a new, unbuilt optimizer."
        )
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    if step_count not in ("release", "global"):
        raise PlanError(f"unknown step_count {step_count!r}; choose 'release' (from each release) or 'global'.")
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"plan must be an ff.Plan, got {type(plan).__name__}.")


class SettingsGoInside:
    """Mixin of ``FreezingOptimizer``: settings assigned after construction reach the inner optimizer.

    ``opt.clipnorm = 1.0`` on the wrapper would otherwise set an attribute
    nothing reads (the inner optimizer does the clipping). The settings an
    optimizer reads at every step go to the inner optimizer and read back
    from it (Keras' ``LossScaleOptimizer`` sets ``loss_scale_factor`` this
    way); those it acts on when built are refused with the fix.
    """

    def __setattr__(self, name, value):
        if name in FORWARDED and "inner_optimizer" in vars(self):
            inner = self.inner_optimizer
            after = dict(vars(inner), **{name: value})
            if name in FORWARDED[:3] and sum(after.get(k) is not None for k in FORWARDED[:3]) > 1:
                raise ValueError(
                    f"FreezingOptimizer.{name} = {value!r}: only one of clipnorm, clipvalue and "
                    "global_clipnorm may be set, and the inner optimizer has another; set that one to None first."
                )
            setattr(inner, name, value)
            return
        if name in CONSTRUCTOR_ONLY and "inner_optimizer" in vars(self):
            refuse_late_setting(self.inner_optimizer, name, value)
        super().__setattr__(name, value)

    def __getattribute__(self, name):
        if name in FORWARDED:
            inner = object.__getattribute__(self, "__dict__").get("inner_optimizer")
            if inner is not None:
                return getattr(inner, name)
        return super().__getattribute__(name)
