"""The exact ``tf.compat.v1`` train op of a graph Freezer.

Per step, inside one op graph:

1. gradients for the Freezer's ``var_list`` only (fully frozen variables
   get none, so no slot either);
2. a partially frozen variable's value is read (the snapshot) and its
   gradient's frozen elements are selected to zero with ``tf.where``, never
   multiplied (``NaN * 0`` is NaN); ``IndexedSlices`` stay sparse;
3. the optimizer's own ``apply_gradients`` runs after the snapshot reads;
4. after it, the frozen elements are written back from the snapshot
   (``tf.where``), so whatever the optimizer did to them (momentum, Adam's
   moments, Ftrl's accumulators, proximal shrinkage) is undone bit for bit.

A resource variable's read is a snapshot: its update ops copy a buffer that
a read still holds. A reference variable's read aliases the buffer that its
update ops change in place, so its snapshot is a ``tf.where`` select into a
fresh buffer.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from finefreeze._errors import PlanError
from finefreeze._resolve.resolve import PARTIAL, TRAINABLE
from finefreeze._resolve.targets import var_path

__all__ = ["apply_op", "train_op", "select_gradient"]


def select_gradient(grad, frozen):
    """``grad`` with the elements where the bool tensor ``frozen`` is True set to zero (``tf.where``).

    ``IndexedSlices`` keep their indices: the mask rows of their indices select their values.
    """
    if isinstance(grad, tf.IndexedSlices):
        rows = tf.gather(frozen, grad.indices)
        values = tf.where(rows, tf.zeros_like(grad.values), grad.values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return tf.where(frozen, tf.zeros_like(grad), grad)


def _check_optimizer(optimizer, what: str) -> None:
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(
            f"{what}() takes a tf.compat.v1.train optimizer (e.g. tf.compat.v1.train.AdamOptimizer), got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}; Keras optimizers go through Freezer.wrap "
            "on eager variables."
        )


def _check_graph(frz) -> None:
    if frz.graph.finalized:
        raise PlanError("the graph is finalized; build the train op with frz.minimize before finalizing it.")


def _check_loss(frz, loss) -> None:
    if not isinstance(loss, tf.Tensor):
        raise PlanError(
            f"the loss must be a tensor of the Freezer's graph, got a {type(loss).__name__}; build it from "
            "the graph's variables under `with g.as_default():`."
        )
    try:
        graph = loss.graph
    except AttributeError:
        graph = None
    if graph is not frz.graph:
        raise PlanError(
            f"the loss {getattr(loss, 'name', loss)!r} is not in the Freezer's graph (it belongs to "
            f"{'an eager context' if graph is None else 'another graph'}); build the loss in the graph "
            "whose variables the Freezer covers."
        )
    if not loss.dtype.is_floating:
        raise PlanError(f"the loss {loss.name!r} has dtype {loss.dtype.name}; it must be a floating-point tensor.")
    reached = _upstream_ops(loss)
    if not any(v.op in reached for v in frz.var_list):
        names = [var_path(v) for v in frz.var_list]
        raise PlanError(
            f"the loss {loss.name!r} depends on none of the {len(names)} variables the plan trains "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); check the plan, or build the loss "
            "from these variables."
        )


def _upstream_ops(t) -> set:
    """Every op that ``t`` depends on (data and control inputs); reads the graph, adds nothing."""
    seen, todo = set(), [t.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(x.op for x in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def train_op(frz, optimizer, loss, *, global_step=None, name: str | None = None, **kwargs: Any) -> tf.Operation:
    """Build the train op of :meth:`Freezer.minimize` (see the module docstring).

    Raises:
        PlanError, TypeError: see :meth:`Freezer.minimize`; nothing is added to the graph.
    """
    _check_optimizer(optimizer, "minimize")
    _check_loss(frz, loss)
    _check_graph(frz)
    with frz.graph.as_default():
        grads_and_vars = optimizer.compute_gradients(loss, var_list=frz.var_list, **kwargs)
        if all(g is None for g, _ in grads_and_vars):  # connected only through non-differentiable ops
            raise PlanError(
                f"the loss {loss.name!r} has no gradient for any of the variables the plan trains "
                "(it reaches them only through non-differentiable ops); nothing to train."
            )
        return _apply(frz, optimizer, grads_and_vars, global_step, name)


def apply_op(frz, optimizer, grads_and_vars, *, global_step=None, name: str | None = None) -> tf.Operation:
    """Build the train op of :meth:`Freezer.apply_gradients`.

    Raises:
        PlanError, TypeError: see :meth:`Freezer.apply_gradients`; nothing is added to the graph.
    """
    _check_optimizer(optimizer, "apply_gradients")
    _check_graph(frz)
    pairs = list(grads_and_vars)
    kept = []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise PlanError(f"grads_and_vars item {i} is not a (gradient, variable) pair: {pair!r}.")
        g, v = pair
        s = frz._res.lookup(v)
        if s is None:
            raise PlanError(
                f"grads_and_vars item {i}: variable {var_path(v) if isinstance(v, tf.Variable) else v!r} is not "
                "one of this Freezer's variables; give the pairs of frz.var_list (optimizer.compute_gradients("
                "loss, var_list=frz.var_list))."
            )
        if s.state in (TRAINABLE, PARTIAL):
            kept.append((g, v))  # fully frozen and untrained variables are left out: never updated
    if all(g is None for g, _ in kept):
        raise PlanError(
            "no gradient for any variable the plan trains in grads_and_vars; give the pairs of frz.var_list."
        )
    with frz.graph.as_default():
        return _apply(frz, optimizer, kept, global_step, name)


def _apply(frz, optimizer, grads_and_vars, global_step, name) -> tf.Operation:
    """Select, apply, write back (the module docstring's steps 2-4), in the default graph."""
    states = {id(s.variable): s for s in frz._res.states if s.state == PARTIAL}
    with tf.compat.v1.name_scope(name, "finefreeze_train"):
        selected, restores = [], []
        for g, v in grads_and_vars:
            s = states.get(id(v))
            if g is None or s is None:
                selected.append((g, v))
                continue
            frozen = tf.constant(s.mask.dense(), name=var_path(v).replace("/", "_") + "_frozen")
            selected.append((select_gradient(g, frozen), v))
            restores.append((v, frozen, _snapshot(v, frozen)))
        with tf.control_dependencies([snap for _, _, snap in restores]):
            update = optimizer.apply_gradients(selected, global_step=global_step)
        with tf.control_dependencies([update]):
            writes = [
                tf.compat.v1.assign(v, tf.where(frozen, snap, v.read_value()), use_locking=True).op
                for v, frozen, snap in restores
            ]
        return tf.group(update, *writes, name="train")


def _snapshot(v, frozen):
    """The variable's value before the update, in a buffer that the update does not change."""
    value = v.read_value()
    if hasattr(v, "handle"):  # a resource variable: the read is a snapshot
        return value
    return tf.where(frozen, value, tf.zeros_like(value))  # a reference variable: copy the frozen part
