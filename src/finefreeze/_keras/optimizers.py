"""What finefreeze reads and changes inside a Keras optimizer.

A Keras optimizer keeps its variables in ``_variables`` (tracked by
``_tracker``), the variables it was built on in ``_trainable_variables``
with their positions in ``_trainable_variables_indices``, keys each by
``_var_key``, decides weight decay per variable in ``_use_weight_decay``
(cached by key in ``_exclude_from_weight_decay_cache``), counts steps in
``_iterations`` and updates each variable in ``update_step`` (PyTorch: a
group at a time in ``_parallel_update_step``). Each function below names the
one of these it relies on.
"""

from __future__ import annotations

import contextlib
import inspect

from finefreeze._keras.instances import instance_value, set_instance_value

__all__ = [
    "base_settings",
    "built_on",
    "counting_from",
    "decay_as",
    "forget_positions",
    "fused_update_step",
    "iterations_variable",
    "nadam_product",
    "optimizer_strategy",
    "own_variables",
    "replace_fused_update_step",
    "replace_update_step",
    "retrack",
    "sub_optimizers",
    "unbuild",
    "untrack",
    "var_key",
    "variable_strategy",
]


def sub_optimizers(opt) -> list:
    """The optimizers a multi-optimizer holds (``_inner_optimizers``), else ``[]``."""
    return list(getattr(opt, "_inner_optimizers", None) or [])


def own_variables(opt) -> list:
    """The variables ``opt`` made (``_variables``: iterations, learning rate, then its state), in order.

    Relies on: ``Optimizer.variables`` is a copy of ``_variables``; the
    list is the one the tracker appends to.
    """
    return opt._variables


def built_on(opt) -> list:
    """The variables ``opt`` was built on (``_trainable_variables``), in build order."""
    return opt._trainable_variables


def forget_positions(opt) -> None:
    """Drop ``opt``'s cache of positions by variable, so the next ``build`` computes them anew.

    Relies on: ``Optimizer.build`` fills ``_trainable_variables_indices``
    only for keys it does not hold, and ``_get_variable_index`` reads it.
    """
    opt._trainable_variables_indices = {}


def unbuild(opt) -> None:
    """Return ``opt`` to unbuilt: no variables it was built on, no caches keyed by them, ``built`` False.

    Relies on: ``build`` starts from ``_trainable_variables``,
    ``_trainable_variables_indices`` and the weight-decay cache (keyed by
    id: new variables may reuse old ids) and refuses to run again while
    ``built``.
    """
    opt._trainable_variables = []
    opt._trainable_variables_indices = {}
    opt._exclude_from_weight_decay_cache = {}
    opt.built = False


def untrack(opt, variables) -> None:
    """Remove ``variables`` from ``opt.variables`` the way Keras' tracker does.

    Relies on: ``_tracker.untrack`` removes a variable from ``_variables``.
    TensorFlow's list wrapper keeps a copy of the list to detect edits made
    around it; after a removal it stops looking at that copy but keeps it,
    and with it the removed variables: the copy is dropped.
    """
    for w in variables:
        opt._tracker.untrack(w)
    state = getattr(opt._variables, "__dict__", {})
    if variables and "_last_wrapped_list_snapshot" in state:
        state["_last_wrapped_list_snapshot"] = None


def retrack(opt, variables) -> None:
    """Make ``opt``'s variables exactly ``variables``, in order (``_tracker.add_to_store("variables", ...)``)."""
    untrack(opt, list(opt._variables))
    for w in variables:
        opt._tracker.add_to_store("variables", w)


def var_key(opt, variable):
    """The key ``opt`` files ``variable``'s state and caches under (``_var_key``)."""
    return opt._var_key(variable)


def decay_as(opt, vector, variable) -> None:
    """Make ``opt`` decay ``vector`` exactly when it decays ``variable`` (both as Keras hands them to it).

    Relies on: ``_use_weight_decay(v)`` decides by the excluded ids, then the
    name patterns, and caches its answer in
    ``_exclude_from_weight_decay_cache[_var_key(v)]``, which it reads first.
    """
    opt._use_weight_decay(vector)  # makes the cache exist
    opt._exclude_from_weight_decay_cache[opt._var_key(vector)] = opt._use_weight_decay(variable)


def iterations_variable(opt):
    """``opt``'s own step counter (``_iterations``; ``opt.iterations`` may be a wrapper's)."""
    return opt._iterations


def nadam_product(opt):
    """Nadam's running product of its momentum schedule (``_u_product``), or None for other optimizers."""
    return getattr(opt, "_u_product", None)


@contextlib.contextmanager
def counting_from(opt, iterations, product=None):
    """Inside the block ``opt.iterations`` reads ``iterations`` (and Nadam's product reads ``product``).

    Relies on: ``iterations`` is a property returning ``_iterations``, and
    ``update_step`` reads the step count and Nadam's ``_u_product`` through
    them; ``Optimizer.__setattr__`` would track what is assigned, so the
    swap goes through ``object.__setattr__``.
    """
    total, own = opt._iterations, getattr(opt, "_u_product", None)
    swap_product = product is not None and own is not None
    if swap_product:
        object.__setattr__(opt, "_u_product", product)
    object.__setattr__(opt, "_iterations", iterations)
    try:
        yield
    finally:
        object.__setattr__(opt, "_iterations", total)
        if swap_product:
            object.__setattr__(opt, "_u_product", own)


def replace_update_step(opt, make) -> bool:
    """Give ``opt`` the per-variable step ``make(plain)`` (``plain``: its own ``update_step``); once per optimizer.

    Relies on: Keras' ``apply`` reaches ``self.update_step(gradient,
    variable, learning_rate)`` per variable (off PyTorch's grouped path).
    Returns False when ``opt`` had it already.
    """
    if instance_value(opt, "_finefreeze_counts", False):
        return False
    set_instance_value(opt, "_finefreeze_counts", True)
    set_instance_value(opt, "update_step", make(opt.update_step))
    return True


def fused_update_step(opt):
    """PyTorch's grouped step (``_parallel_update_step(grads, variables, learning_rate)``), else None.

    Relies on: Keras' PyTorch optimizers define it and call it for all
    variables at once; no other backend's optimizer has it.
    """
    return getattr(opt, "_parallel_update_step", None)


def replace_fused_update_step(opt, step) -> None:
    """Make ``step`` ``opt``'s grouped PyTorch step (see :func:`fused_update_step`)."""
    set_instance_value(opt, "_parallel_update_step", step)


def optimizer_strategy(opt):
    """The ``tf.distribute`` strategy a TensorFlow Keras optimizer was made under (``_distribution_strategy``), or None."""
    return getattr(opt, "_distribution_strategy", None)


def variable_strategy(variable):
    """The ``tf.distribute`` strategy whose scope made a ``tf.Variable`` (TensorFlow's ``_distribute_strategy``), or None."""
    return getattr(variable, "_distribute_strategy", None)


def base_settings() -> set[str]:
    """The settings every Keras optimizer's constructor takes (``BaseOptimizer.__init__``'s parameters).

    Relies on: ``keras.src.optimizers.base_optimizer.BaseOptimizer``; the
    public ``keras.optimizers.Optimizer`` is a backend's subclass whose
    signature may be ``*args, **kwargs``.
    """
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return set(inspect.signature(BaseOptimizer.__init__).parameters)
