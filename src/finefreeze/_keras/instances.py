"""Attributes set on objects finefreeze does not own, and Keras' global state.

Python looks an attribute up in the instance's ``__dict__`` before its
class, so a function stored there under ``"call"`` is the call of that one
layer (Keras' ``Layer.__call__`` reads ``self.call``), and removing it gives
the class's back. Keras' ``Layer.__setattr__`` and ``Optimizer.__setattr__``
track what is assigned (layers, variables, lists); writing to ``__dict__``
bypasses that tracking, so nothing set here is saved or counted as a weight.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = [
    "MISSING",
    "attributes",
    "in_stateless_scope",
    "instance_value",
    "no_tracking",
    "outside_the_trace",
    "patched",
    "remove_instance_value",
    "restore_attributes",
    "seed_keras_only",
    "set_instance_value",
    "set_tag",
    "tag",
]

#: the default of :func:`instance_value` and :func:`tag`: "not set"
MISSING: Any = object()


def set_instance_value(obj, name: str, value) -> None:
    """Set ``name`` in ``obj``'s own ``__dict__``, past Keras' attribute tracking.

    Relies on: Keras layers and optimizers are plain Python objects with a
    ``__dict__`` that attribute lookup reads before the class (a function
    stored as ``"call"`` becomes the instance's call).
    """
    obj.__dict__[name] = value


def instance_value(obj, name: str, default=MISSING):
    """``name`` from ``obj``'s own ``__dict__`` (set by :func:`set_instance_value`), or ``default``."""
    return getattr(obj, "__dict__", {}).get(name, default)


def remove_instance_value(obj, name: str) -> None:
    """Remove ``name`` from ``obj``'s own ``__dict__`` (the class's attribute shows again); absent: nothing."""
    getattr(obj, "__dict__", {}).pop(name, None)


@contextlib.contextmanager
def patched(obj, **functions):
    """``obj``'s own attributes replaced by ``functions`` inside the block, removed after it.

    Relies on: Keras optimizers call ``self.add_variable`` and
    ``self.add_variable_from_reference`` by attribute in ``build``, so an
    instance's own functions see every variable it makes.
    """
    for name, fn in functions.items():
        set_instance_value(obj, name, fn)
    try:
        yield
    finally:
        for name in functions:
            remove_instance_value(obj, name)


def tag(obj, name: str, default=MISSING):
    """finefreeze's mark ``name`` on ``obj`` (a Keras variable, layer or model), or ``default``."""
    return getattr(obj, name, default)


def set_tag(obj, name: str, value) -> None:
    """Mark ``obj`` with ``name`` (a ``_finefreeze_...`` attribute, never saved by Keras).

    Relies on: Keras saves a layer's config and its tracked variables, never
    a plain attribute; ``keras.Variable`` takes new attributes.
    """
    setattr(obj, name, value)


def attributes(obj) -> dict:
    """A shallow copy of ``obj``'s attributes, for :func:`restore_attributes` (an undo of a rebuild)."""
    return dict(vars(obj))


def restore_attributes(obj, saved: dict) -> None:
    """Put ``obj``'s attributes back to ``saved`` (from :func:`attributes`), all of them.

    Relies on: a Keras optimizer's state is its ``__dict__`` (variable lists,
    tracker, build flags): restoring it restores what ``build`` changed.
    """
    vars(obj).clear()
    vars(obj).update(saved)


def no_tracking(fn):
    """``fn`` with Keras' attribute tracking off (Keras' ``no_automatic_dependency_tracking``).

    Relies on: ``keras.src.utils.tracking.no_automatic_dependency_tracking``
    stops ``Layer.__setattr__`` / ``Optimizer.__setattr__`` from tracking what
    ``fn`` assigns.
    """
    from keras.src.utils.tracking import no_automatic_dependency_tracking

    return no_automatic_dependency_tracking(fn)


@contextlib.contextmanager
def outside_the_trace():
    """Variables made eagerly and unseen by ``tf.function``, while Keras' TensorFlow trainer traces its first step.

    Relies on: Keras' TensorFlow trainer, without a distribution strategy,
    builds the optimizer while ``tf.function`` traces the first step;
    TensorFlow keeps the variable creators of a context in its graph's
    ``_variable_creator_stack``, where ``tf.function`` puts one of its own
    while it traces a first call, and traces the call again (keeping both
    graphs) once that creator has seen a variable made. Under
    ``tf.init_scope`` with that stack emptied, a variable is a plain eager one.
    Without the attribute: ``tf.init_scope`` alone (eager, traced twice).
    """
    import tensorflow as tf

    with tf.init_scope():
        graph = tf.compat.v1.get_default_graph()
        creators = getattr(graph, "_variable_creator_stack", None)
        if creators is None:
            yield
            return
        graph._variable_creator_stack = []
        try:
            yield
        finally:
            graph._variable_creator_stack = creators


def in_stateless_scope() -> bool:
    """Whether Keras runs a stateless call now (``StatelessScope``: JAX's trainer, ``stateless_call``).

    Relies on: ``keras.src.backend.common.stateless_scope.in_stateless_scope``.
    """
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside

    return bool(inside())


def seed_keras_only(seed: int) -> None:
    """Seed Keras' global random state without importing TensorFlow (``keras.utils.set_random_seed`` imports it).

    Relies on: Keras keeps its global seed in ``global_state`` under
    ``rng_utils.GLOBAL_RANDOM_SEED`` and makes its global ``SeedGenerator``
    anew from it once ``seed_generator.GLOBAL_SEED_GENERATOR`` is None.
    """
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
