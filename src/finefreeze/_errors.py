"""Exception types of finefreeze: one per kind of failure."""

from __future__ import annotations

__all__ = ["PlanError", "FrozenValueChanged", "DeltaError", "FreezeWarning"]


class PlanError(ValueError):
    """A plan, rule or selector cannot be resolved against a target.

    Raised before anything in the model changes: a failing ``Freezer`` leaves
    every ``trainable`` flag as it was.

    Example:
        >>> import finefreeze as ff
        >>> try:
        ...     ff.freeze("dense/kernel[0:")
        ... except ff.PlanError as e:
        ...     print(type(e).__name__)
        PlanError
    """


class FrozenValueChanged(AssertionError):
    """A frozen element differs from the fingerprint taken at freeze time.

    ``violations`` lists ``(path, description)`` pairs, one per offending
    variable.

    Example:
        >>> import finefreeze as ff
        >>> issubclass(ff.FrozenValueChanged, AssertionError)
        True
    """

    def __init__(self, message: str, violations: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.violations = list(violations or [])


class DeltaError(ValueError):
    """A delta file does not fit the base it is applied to, or is damaged.

    Example:
        >>> import finefreeze as ff
        >>> issubclass(ff.DeltaError, ValueError)
        True
    """


class DistributionError(RuntimeError):
    """A Freezer or optimizer does not belong to the ``tf.distribute`` strategy of its model.

    Raised when it is created outside the ``strategy.scope()`` that built
    the model (or inside another strategy's scope), before anything changes.

    Example:
        >>> import finefreeze as ff
        >>> issubclass(ff.DistributionError, RuntimeError)
        True
    """


class FreezeWarning(UserWarning):
    """Something that works but is probably not what you want.

    Raised for the inexact ``mask`` strategy and for rules that select
    nothing under ``strict=False``.

    Example:
        >>> import finefreeze as ff
        >>> issubclass(ff.FreezeWarning, UserWarning)
        True
    """
