"""A quantized kernel's trained part: a float delta beside the integers, added in the forward pass.

Keras' ``quantize("int8")`` / ``("int4")`` leaves a ``Dense`` or
``EinsumDense`` kernel as integers and scales that no optimizer may write.
When a plan trains some of its elements, the layer's stand-in (``standins``)
holds a *delta* of those elements instead of their values: zero at first,
of the layer's variable dtype, updated by the optimizer (``compact``: its
state is the delta's size) and never written into the kernel. The layer's
``quantized_call`` (set on the instance) computes::

    y = activation(quantized_product(x) + delta_product(x) + bias)

``quantized_product`` is Keras' own (LoRA included when enabled), so the
integers, their scales and what Keras computes from them stay as they are,
bit for bit; ``delta_product`` is the product of ``x`` with the delta in the
kernel's logical (float) shape, computed for what trains only:

- a block of the kernel (rows, columns, heads; :class:`~finefreeze._slices.product.Taken`):
  ``x`` gathered along the block's contracted axes times the delta as a
  block, placed along the output's axes: the product and its gradients are
  the block's size;
- scattered elements (:class:`~finefreeze._slices.sampled.Sampled`): the
  delta laid into the kernel's shape for the product and, again, for the
  input's gradient (a temporary of one kernel in float, kept by no step),
  and its gradient the sampled product at those elements only.

Example:
    >>> import keras, numpy as np
    >>> d = keras.layers.Dense(4); d.build((None, 3)); d.quantize("int8")
    >>> from finefreeze._keras.quantized import logical_shape
    >>> logical_shape(d)
    (3, 4)
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from finefreeze._backends.chosen import chosen
from finefreeze._errors import PlanError
from finefreeze._keras.instances import instance_value
from finefreeze._keras.quantized import quantized_product
from finefreeze._slices.choose import MARK
from finefreeze._slices.product import Taken

__all__ = ["block_delta", "carry", "delta_call", "delta_kept", "scattered_delta"]


def _place(t, axis: int, idx: np.ndarray, place, n: int):
    """``t`` (``len(idx)`` long along ``axis``) laid out ``n`` long: its slices at ``idx``, zeros elsewhere."""
    axis = axis % len(t.shape)
    if isinstance(place, tuple):
        pad = [(0, 0)] * len(t.shape)
        pad[axis] = (place[0], n - place[1])
        return ops.pad(t, pad)
    inverse = np.full(n, len(idx), np.int32)  # a slot past the block: the zeros
    inverse[idx] = np.arange(len(idx), dtype=np.int32)
    zeros = ops.zeros_like(ops.take(t, ops.convert_to_tensor(np.zeros(1, np.int32)), axis=axis))
    return ops.take(ops.concatenate([t, zeros], axis=axis), ops.convert_to_tensor(inverse), axis=axis)


def block_delta(op, x, values, taken: Taken):
    """``op(x, delta)`` for a delta whose trained elements lie in ``taken``'s block, from the block alone.

    Args:
        op: the layer's product ``(x, kernel) -> y``.
        x: the layer's input.
        values: the delta of the trained elements (flat, in the kernel's sorted flat order).
        taken: the block.

    Returns:
        The delta's contribution to ``y``; its gradients are the block's (the trained elements' only, by the
        backend's own differentiation).
    """
    block = taken.block_shape
    if taken.positions is None:
        kernel = ops.reshape(values, block)
    else:
        where = ops.expand_dims(ops.convert_to_tensor(taken.positions), 1)
        kernel = ops.reshape(ops.scatter(where, values, (int(np.prod(block, dtype=np.int64)),)), block)
    y = op(taken.take_x(x), ops.cast(kernel, x.dtype))
    for i, idx in enumerate(taken.index):
        if idx is not None and taken.y_axis[i] is not None:
            y = _place(y, taken.y_axis[i], idx, taken.places[i], taken.shape[i])
    return y


def scattered_delta(op, x, values, flat, sampled, shape):
    """``op(x, delta)`` for a delta of scattered elements: their gradient by the sampled product.

    Args:
        op: the layer's product.
        x: the layer's input.
        values: the delta of the trained elements (flat, sorted flat order).
        flat: their flat indices as the sampled product reads them (padded past ``len(values)``).
        sampled: the :class:`~finefreeze._slices.sampled.Sampled` product of those elements.
        shape: the kernel's logical shape.

    Returns:
        The delta's contribution to ``y``. No kernel-shaped value is kept for the backward: the delta is laid
        into the kernel's shape again there, for the input's gradient.
    """
    count, size = int(values.shape[0]), int(np.prod(shape, dtype=np.int64))
    dtype = values.dtype

    def dense(v, f):
        where = ops.expand_dims(f[:count], 1)
        return ops.cast(ops.reshape(ops.scatter(where, v, (size,)), shape), x.dtype)

    @ops.custom_gradient
    def product(x, v, f):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            kernel = dense(v, f)
            dx = chosen().vjp(lambda k, a: op(a, k), kernel, x, upstream)
            dv = sampled.weight_gradient(x, upstream, f)
            return dx, ops.cast(dv, dtype), None

        return op(x, dense(v, f)), grad

    return product(x, values, flat)


def delta_call(layer, ks, taken, product, standin, index, bias_and_activation):
    """The ``quantized_call`` of a quantized layer whose kernel's trained part is a float delta.

    Args:
        layer: the quantized ``Dense`` or ``EinsumDense``.
        ks: the :class:`~finefreeze._slices.choose.KernelSlice` of the trained elements.
        taken: its :class:`Taken` block, or its ``Sampled`` product.
        product: the layer's float product ``(x, kernel) -> y``.
        standin: ``() -> the delta's value``.
        index: ``() -> the sampled product's flat indices`` (None for a block).
        bias_and_activation: ``(layer, y) -> y``: the rest of the layer's call.
    """

    def call(inputs, training=None):
        y = quantized_product(layer, inputs, training=training)
        x = ops.cast(inputs, y.dtype)
        if ks.kind == "sampled":
            delta = scattered_delta(product, x, standin(), index(), taken, ks.shape)
        else:
            delta = block_delta(product, x, standin(), taken)
        return bias_and_activation(layer, ops.add(y, ops.cast(delta, y.dtype)))

    return call


def delta_kept(layer, new):
    """A quantized kernel's delta in place, ``(its elements, its values)``, for the call that replaces it.

    Raises:
        PlanError: the new plan freezes elements whose delta is not zero (their trained value would be lost).
    """
    mark = instance_value(layer, MARK, None)
    if mark is None or not mark.quantized or mark.holder is None:
        return None
    values = np.asarray(keras.ops.convert_to_numpy(mark.standin))
    kept = np.zeros(0, np.int64) if new is None else np.flatnonzero(~np.asarray(new[5], dtype=bool))
    lost = np.setdiff1d(mark.index[values != 0], kept)
    if lost.size:
        raise PlanError(
            f"the plan freezes {lost.size} element(s) of {mark.variable.path!r}, a quantized kernel whose float "
            f"delta holds trained values there (first flat index {int(lost[0])}): freezing them would drop what "
            "they learned. Keep them trained, or save the model's delta first (save_delta) and start from the base."
        )
    return mark.index, values


def carry(layer, kept) -> None:
    """Write a replaced delta's values into the new one, at the elements both hold."""
    mark = instance_value(layer, MARK, None)
    if kept is None or mark is None or not mark.quantized or mark.holder is None:
        return
    old_index, values = kept
    common, mine, theirs = np.intersect1d(mark.index, old_index, assume_unique=True, return_indices=True)
    if common.size:
        new = np.asarray(keras.ops.convert_to_numpy(mark.standin)).copy()
        new[mine] = values[theirs]
        mark.standin.assign(new)
