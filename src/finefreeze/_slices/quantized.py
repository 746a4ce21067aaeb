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
  product read at the elements alone (``x``'s column of each, times its
  delta, summed into ``y``'s column), the input's gradient likewise from
  ``dy``, and the delta's gradient the sampled product: no value of the
  kernel's shape exists in the step.

A quantized ``Embedding`` (or ``ReversibleEmbedding``) table trains rows
(new tokens) the same way, added to their lookups (and a tied table's
logits); an untied ``ReversibleEmbedding``'s output table, quantized on its
own, has a delta of its own (a second mark of the layer), added to the
logits as a ``Dense`` kernel's is to ``y`` (:func:`table_call`).

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
from finefreeze._keras.quantized import quantized_lookup, quantized_product
from finefreeze._slices.choose import MARKS
from finefreeze._slices.product import Taken
from finefreeze._slices.sampled import SAMPLED_CHUNK

__all__ = ["block_delta", "carry", "delta_call", "delta_kept", "scattered_delta", "table_call", "table_parts"]


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


def _columns_of(sampled, t, spec: str, kernel_letters: list[str], width: int):
    """``t`` as ``(N, width)`` (as the sampled product lays it out), and the function that lays it back."""
    perm = sampled.permutation(len(t.shape), spec, kernel_letters)
    moved = [t.shape[i] for i in perm]
    inverse = list(np.argsort(perm))

    def back(t2):
        t2 = ops.reshape(t2, [-1 if d is None else d for d in moved])
        return t2 if perm == list(range(len(perm))) else ops.transpose(t2, inverse)

    return sampled._as_columns(t, spec, kernel_letters, width), back


def scattered_delta(op, x, values, flat, sampled, shape):
    """``op(x, delta)`` for a delta of scattered elements, read at those elements alone.

    ``y[n, b] += x[n, a] * delta[e]`` for each element ``e`` = ``(a, b)``
    (the columns of ``x`` and ``y`` it joins, as the sampled product lays
    them out); the input's gradient likewise from ``dy``, and the delta's
    the sampled product's. Nothing of the kernel's shape is made.

    Args:
        op: the layer's product (unused: the product is read at the elements).
        x: the layer's input.
        values: the delta of the trained elements (flat, sorted flat order).
        flat: their flat indices as the sampled product reads them (padded past ``len(values)``).
        sampled: the :class:`~finefreeze._slices.sampled.Sampled` product of those elements.
        shape: the kernel's logical shape.

    Returns:
        The delta's contribution to ``y``.
    """
    count, dtype = int(values.shape[0]), values.dtype

    @ops.custom_gradient
    def product(x, v, f):
        a, b = sampled.columns(f[:count])
        x2, back = _columns_of(sampled, x, sampled.x_spec, sampled.xk, sampled.width_x)
        y2 = chosen().scattered_product(x2, v, a, b, sampled.width_y, SAMPLED_CHUNK)
        y = _laid_out(sampled, x, y2)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            dy2, _ = _columns_of(sampled, upstream, sampled.y_spec, sampled.yk, sampled.width_y)
            dx = back(chosen().scattered_product(dy2, v, b, a, sampled.width_x, SAMPLED_CHUNK))
            dv = sampled.weight_gradient(x, upstream, f)
            return ops.cast(dx, x.dtype), ops.cast(dv, dtype), None

        return y, grad

    return product(x, values, flat)


def _laid_out(sampled, x, y2):
    """``y2`` (``(N, B)``) as the layer's output: ``x``'s batch axes, then the output's own, in ``y_spec``'s order."""
    x_spec, y_spec = sampled.x_spec, sampled.y_spec
    if "..." in x_spec:
        pre, post = x_spec.split("...")
        lead = list(x.shape[len(pre) : len(x.shape) - len(post)])
        named = {c: x.shape[i] for i, c in enumerate(pre)}
        named.update({c: x.shape[len(x.shape) - len(post) + i] for i, c in enumerate(post)})
    else:
        lead, named = [], {c: x.shape[i] for i, c in enumerate(x_spec)}
    named.update(sampled.dims)
    if "..." in y_spec:
        ypre, ypost = y_spec.split("...")
        letters = list(ypre) + [f"_{i}" for i in range(len(lead))] + list(ypost)
        named.update({f"_{i}": d for i, d in enumerate(lead)})
    else:
        letters = list(y_spec)
    batch = sorted((c for c in letters if c not in sampled.k_spec), key=sampled._batch_order)
    perm = [letters.index(c) for c in batch + sampled.yk]
    moved = [named[letters[i]] for i in perm]
    y = ops.reshape(y2, [-1 if d is None else d for d in moved])
    return y if perm == list(range(len(perm))) else ops.transpose(y, list(np.argsort(perm)))


def delta_call(layer, ks, taken, product, standin, index, bias_and_activation):
    """The ``quantized_call`` of a quantized layer whose kernel's trained part is a float delta.

    Args:
        layer: the quantized ``Dense`` or ``EinsumDense`` (an ``Embedding``: :func:`table_call`).
        ks: the :class:`~finefreeze._slices.choose.KernelSlice` of the trained elements.
        taken: its :class:`Taken` block, or its ``Sampled`` product.
        product: the layer's float product ``(x, kernel) -> y``.
        standin: ``() -> the delta's value``.
        index: ``() -> the sampled product's flat indices`` (None for a block).
        bias_and_activation: ``(layer, y) -> y``: the rest of the layer's call.
    """
    if isinstance(layer, keras.layers.Embedding):
        return table_call(layer)

    def call(inputs, training=None):
        y = quantized_product(layer, inputs, training=training)
        x = ops.cast(inputs, y.dtype)
        delta = _product_delta(product, x, ks, taken, standin, index)
        return bias_and_activation(layer, ops.add(y, ops.cast(delta, y.dtype)))

    return call


def _product_delta(product, x, ks, taken, standin, index):
    """``x`` times the delta (of scattered elements, or of a block)."""
    if ks.kind == "sampled":
        return scattered_delta(product, x, standin(), index(), taken, ks.shape)
    return block_delta(product, x, standin(), taken)


def table_parts(layer, ks, taken, standin, index):
    """What a quantized table's delta adds: ``(lookup, logits)``, each ``(inputs, out) -> out`` or None.

    The token table's delta rows (new tokens) add to the lookup of their
    ids, and, when the table is tied, ``h`` times them to their logits; an
    untied output table's delta (``reverse_embeddings``, ``(hidden,
    vocabulary)``) adds ``h`` times it to the logits, as a ``Dense`` kernel's.
    """
    if ks.kind != "rows":  # the untied output table

        def table_logits(h, logits):
            return ops.add(logits, ops.cast(_product_delta(ops.matmul, h, ks, taken, standin, index), logits.dtype))

        return None, table_logits
    rows = taken.index[0] if taken.index[0] is not None else np.arange(ks.shape[0], dtype=np.int32)
    span = taken.places[0] if taken.places[0] is not None else (0, ks.shape[0])  # every row: a range
    place = np.full(ks.shape[0], len(rows), np.int32)  # each id's row of the delta, or the zero row past it
    place[rows] = np.arange(len(rows), dtype=np.int32)
    block = (len(rows), ks.shape[1])

    def delta_rows(dtype):
        if taken.positions is None:
            d = ops.reshape(standin(), block)
        else:
            where = ops.expand_dims(ops.convert_to_tensor(taken.positions), 1)
            d = ops.reshape(ops.scatter(where, standin(), (block[0] * block[1],)), block)
        return ops.cast(d, dtype)

    def lookup(ids, out):
        d = delta_rows(out.dtype)
        padded = ops.concatenate([d, ops.zeros((1, block[1]), dtype=out.dtype)], axis=0)
        ids = ops.where(ids < 0, ids + ks.shape[0], ids)  # counted from the end, as Keras takes them
        return ops.add(out, ops.take(padded, ops.take(ops.convert_to_tensor(place), ids, axis=0), axis=0))

    def tied_logits(h, logits):
        extra = ops.matmul(h, ops.transpose(delta_rows(logits.dtype)))
        return ops.add(logits, _place(extra, -1, rows, span, ks.shape[0]))

    return lookup, (tied_logits if getattr(layer, "tie_weights", False) else None)


def table_call(layer):
    """The ``quantized_call`` of a quantized ``Embedding`` (or ``ReversibleEmbedding``) with a float delta.

    Keras' quantized lookup (reverse projection) plus what the deltas of
    its marks add (:func:`table_parts`): the table's, and an untied output
    table's, read when the call is traced; the reverse projection's soft cap
    comes after them.
    """

    def parts():
        for name in MARKS:
            mark = instance_value(layer, name, None)
            if mark is not None and mark.quantized and mark.holder is not None:
                yield mark.parts

    def call(inputs, reverse=False, **kwargs):
        if reverse:
            logits = quantized_product(layer, inputs, reverse=True)
            h = ops.cast(inputs, logits.dtype)
            for _, add in parts():
                logits = logits if add is None else add(h, logits)
            if getattr(layer, "logit_soft_cap", None) is not None:
                cap = layer.logit_soft_cap
                logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
            return logits
        ids = inputs if inputs.dtype in ("int32", "int64") else ops.cast(inputs, "int32")
        out = quantized_lookup(layer, ids)
        for add, _ in parts():
            out = out if add is None else add(ids, out)
        return out

    return call


def delta_kept(layer, name, new):
    """A quantized kernel's delta in place (the mark ``name`` of ``layer``), ``(its elements, its values)``.

    Read before the call that replaces it is set.

    Raises:
        PlanError: the new plan freezes elements whose delta is not zero (their trained value would be lost).
    """
    mark = instance_value(layer, name, None)
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


def carry(layer, name, kept) -> None:
    """Write a replaced delta's values into the new one (the mark ``name`` of ``layer``), at the elements both hold."""
    mark = instance_value(layer, name, None)
    if kept is None or mark is None or not mark.quantized or mark.holder is None:
        return
    old_index, values = kept
    common, mine, theirs = np.intersect1d(mark.index, old_index, assume_unique=True, return_indices=True)
    if common.size:
        new = np.asarray(keras.ops.convert_to_numpy(mark.standin)).copy()
        new[mine] = values[theirs]
        mark.standin.assign(new)
