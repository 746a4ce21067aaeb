"""``tf.distribute`` facts: which strategy owns a model, every replica's copy of a variable.

On other Keras backends there is no ``tf.distribute``: every check passes and
a variable has one copy.
"""

from __future__ import annotations

import contextlib

import numpy as np

from finefreeze._backends.arrays import native, to_numpy
from finefreeze._backends.questions import tensorflow
from finefreeze._backends.read import read
from finefreeze._errors import DistributionError
from finefreeze._keras.optimizers import optimizer_strategy, variable_strategy

__all__ = ["owner_strategy", "check_cross_replica", "check_scope", "check_optimizer", "owner_scope", "replica_values"]


def owner_strategy(variables):
    """The ``tf.distribute`` strategy whose scope created ``variables``, or None."""
    owners = {}
    for v in variables:
        s = variable_strategy(native(v))
        if s is not None:
            owners[id(s)] = s
    if len(owners) > 1:
        raise DistributionError(
            f"the variables belong to {len(owners)} different tf.distribute strategies; "
            "build the whole model inside one strategy.scope()."
        )
    return next(iter(owners.values()), None)


def check_scope(variables, what: str, paths=()) -> None:
    """Raise DistributionError unless ``what`` is created in the scope of the strategy that owns ``variables``."""
    tf = tensorflow()
    if tf is None:
        return
    variables = list(variables)
    owner = owner_strategy(variables)
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    example = f" (e.g. {paths[0]!r})" if paths else ""
    if owner is not None and current is not owner:
        where = f"in the scope of another {type(current).__name__}" if current is not None else "outside its scope"
        raise DistributionError(
            f"{what} is created {where}, but the model's {len(variables)} variables{example} belong to "
            f"a {type(owner).__name__}. Create it inside `with strategy.scope():` of that strategy, "
            "where the model was built."
        )
    if owner is None and current is not None and variables:
        raise DistributionError(
            f"{what} is created inside a {type(current).__name__}.scope(), but the model's variables{example} "
            "were created outside it. Build the model inside the same `with strategy.scope():`."
        )


def check_optimizer(opt, variables, what: str) -> None:
    """The optimizer (and its inner optimizer) must belong to the strategy that owns ``variables``."""
    owner = owner_strategy(variables)
    if owner is None:
        return
    for o in (opt, getattr(opt, "inner_optimizer", None)):
        s = optimizer_strategy(o)
        if o is not None and s is not owner:
            raise DistributionError(
                f"{what}: the optimizer {type(o).__name__} was created outside the scope of the "
                f"{type(owner).__name__} that owns the model; create optimizers inside "
                "`with strategy.scope():`."
            )


def check_cross_replica(var_list) -> None:
    """Raise DistributionError when an optimizer of mirrored ``var_list`` is built inside ``strategy.run``."""
    tf = tensorflow()
    if tf is not None and owner_strategy(var_list) is not None and not tf.distribute.in_cross_replica_context():
        raise DistributionError(
            "FreezingOptimizer is being built inside strategy.run: build it in the strategy's "
            "scope first (model.compile + fit do; in a custom loop call "
            "opt.build(frz.trainable_variables) inside `with strategy.scope():`)."
        )


def owner_scope(variables):
    """The owning strategy's scope when called outside it (eager writes, new variables); else a no-op."""
    tf = tensorflow()
    owner = owner_strategy(variables) if tf is not None else None
    if owner is None or tf.distribute.has_strategy():
        return contextlib.nullcontext()
    return owner.scope()


def replica_values(variable) -> list[np.ndarray]:
    """The value of every replica's copy of ``variable`` (one item when not distributed)."""
    v = native(variable)
    copies = getattr(v, "values", None)
    if isinstance(copies, tuple) and copies:
        return [to_numpy(c) for c in copies]
    return [read(variable)]
