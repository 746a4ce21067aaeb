"""Layers whose kernel's trained elements get their own gradient: their ``call``, set on the instance.

For each partially frozen kernel :func:`finefreeze._slices.choose.choose`
finds a block (or scattered elements) for, the layer gets a ``call`` of its
own instance (in its ``__dict__``, as Python looks there first): Keras' call
of that class line for line (``Dense``, ``EinsumDense``, the convolutions,
``Embedding`` and ``ReversibleEmbedding``'s lookup and tied reverse
projection), with the kernel product (an embedding's lookup) replaced by
:func:`finefreeze._slices.product.sliced_product`, which hands the trained
elements' gradient to a stand-in (``standins``). Nothing of it is saved:
the layer keeps its class and its config, and a model saved while it trains
loads as plain Keras. A layer that two live Freezers plan (two plans
trained by turns, as a GAN's) is never sliced: the gradient the layer
computes cannot know which plan's optimizer will apply it. The call falls
back to the class's own when the Freezer that set it is gone, inside
:func:`finefreeze._slices.product.full_gradients` (``select``
scores every element) and when the Freezer's ``gradients="dense"``.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import weakref
from typing import Any

import keras
import numpy as np
from keras import ops

from finefreeze._backends.chosen import chosen, lookups_are_sparse
from finefreeze._errors import PlanError
from finefreeze._keras.instances import instance_value, remove_instance_value, set_instance_value
from finefreeze._keras.layers import causal_padding, remat_each_call, rematerialized, set_keras_mask
from finefreeze._resolve.resolve import PARTIAL
from finefreeze._resolve.standins import attach, detach
from finefreeze._slices.choose import MARKS, SAMPLED_KINDS, KernelSlice, choose, mark_name, quantized
from finefreeze._slices.product import Taken, looked_up, read_rows, sliced_product, slicing
from finefreeze._slices.quantized import carry, delta_call, delta_kept, table_parts
from finefreeze._slices.sampled import Sampled, TableElements, padded_index

__all__ = ["set_sliced"]

#: the attribute of a layer holding (weakly) every Freezer that planned it: two live ones keep it dense
CLAIMS = "_finefreeze_claims"


def _claims(layer) -> weakref.WeakSet:
    """The Freezers that planned ``layer`` (weakly), made empty on first use."""
    claims = instance_value(layer, CLAIMS, None)
    if claims is None:
        claims = weakref.WeakSet()
        set_instance_value(layer, CLAIMS, claims)
    return claims


@dataclasses.dataclass(eq=False)
class _Mark:
    slice: KernelSlice
    variable: Any
    owner: Any  # weak reference to the Freezer
    sliced: bool = True  # False: a TensorFlow table read sparsely under gradients="dense" (Keras' own gradient)
    claims: Any = ()  # the layer's claims: two live Freezers keep it dense
    # the Freezer's gradients mode slices it, held dense or not: the layout (compact's state) follows this, so a
    # run holding a kernel dense and one that slices it keep the same optimizer variables (checkpoints load)
    eligible: bool = True
    holder: Any = None  # the stand-in's layer (eligible slices): the trained elements' variable
    trained: bytes = b""  # the trained elements (flat indices), to tell a new stand-in from the one in place
    quantized: bool = False  # the kernel is quantized: the stand-in is a delta the call always adds
    index: Any = None  # a quantized kernel's: the sorted flat indices of the delta's elements (numpy)
    parts: Any = None  # a quantized table's: what its delta adds to the lookup and the logits (table_parts)

    @property
    def standin(self):
        """The stand-in variable of the trained elements, or None."""
        return None if self.holder is None else self.holder.values

    def live(self) -> bool:
        """The Freezer that set the call lives and is the only one planning the layer."""
        return self.owner() is not None and len(self.claims) == 1

    def now(self) -> bool:
        """Whether the call hands the trained elements' gradient to the stand-in, were it traced now."""
        if self.quantized:  # the delta is the model's, whichever Freezer set it
            return self.holder is not None
        return self.sliced and self.holder is not None and self.live()


def set_sliced(target, res, owner, mode: str = "sliced", held: set | None = None, often: bool = False) -> bool:
    """Give every layer of ``target`` the call ``res`` asks for; return whether any call changed.

    Args:
        target: the collected target.
        res: the resolution in force.
        owner: the Freezer (held weakly: once it is gone, the layers compute dense gradients).
        mode: the Freezer's ``gradients``. ``"dense"``: no layer is sliced (on
            TensorFlow a partially frozen ``Embedding`` still reads its table
            by rows, which changes no maths: the gradient is Keras' own);
            ``"sliced"``: every slice (or sampled kernel) :func:`~finefreeze._slices.choose.choose`
            finds; ``"auto"``: those :func:`~finefreeze._slices.choose.pays` says pay, but not the
            paths in ``held``.
        held: ``"auto"``: paths kept dense.
        often: the plan changes again soon (``Reselect``): under ``"auto"`` a
            sliced kernel whose slice moves joins ``held`` (the dense path
            changes masks without a retrace; a moved slice retraces the step).
    """
    if target.kind != "keras":
        return False
    held = set() if held is None else held
    marks = {
        (id(layer), name): instance_value(layer, name, None)
        for layer in target.layers
        if hasattr(layer, "__dict__")
        for name in MARKS
    }
    want = {}
    for s in res.states:
        if s.state == PARTIAL and s.info.is_keras and s.info.owner is not None:
            frozen = s.mask.dense()
            ks, eligible = choose(s.info.owner, s.variable, frozen, mode)
            on = eligible and (s.info.quantized is not None or not (mode == "auto" and s.path in held))
            key = (id(s.info.owner), mark_name(s.info.owner, s.variable))
            old = marks.get(key)
            if mode == "auto" and often and on and old is not None and old.sliced and old.variable is s.variable:
                if old.slice.key != ks.key:  # the slice moved and will move again: the dense path from now on
                    held.add(s.path)
                    on = False
            # TensorFlow's table read by rows changes no maths: it is the dense path too
            if ks is not None and (eligible or (ks.kind == "rows" and lookups_are_sparse(s.info.owner))):
                want[key] = (s.info.owner, ks, s.variable, on, eligible, frozen)
    layers = [layer for layer in target.layers if hasattr(layer, "__dict__")]
    for layer in layers:
        _claims(layer).add(owner)
    planned = {key[0] for key in want}
    if any(len(_claims(layer)) > 1 for layer in layers if id(layer) in planned):
        gc.collect()  # a Freezer dropped in a reference cycle is not another plan
    for layer in layers:  # another live Freezer plans this layer: which plan's optimizer trains is not known
        if len(_claims(layer)) > 1:
            if any(quantized(layer, want[(id(layer), name)][2]) for name in MARKS if (id(layer), name) in want):
                raise PlanError(
                    f"two live Freezers plan {layer.path!r}, whose kernel is quantized: what trains of it is one "
                    "float delta beside the integers, which one plan's optimizer owns, and each Freezer plans every "
                    "layer of its model (a layer one of them freezes too). Train both parts in one Freezer's plan, "
                    "or drop the other Freezer first (del frz)."
                )
            for name in MARKS:
                want.pop((id(layer), name), None)
    keys = [(layer, name) for layer in layers for name in MARKS]
    carried = {(id(la), n): delta_kept(la, n, want.get((id(la), n))) for la, n in keys}  # refuses before any change
    changed = False
    for layer, name in keys:
        mark = instance_value(layer, name, None)
        new = want.get((id(layer), name))
        if _same(mark, new):  # a kernel held dense keeps Keras' call whatever its slice: no retrace when it moves
            mark.owner, mark.slice = weakref.ref(owner), new[1]
            continue
        if mark is not None:
            _take_call(layer, mark)
            changed = True
        if new is not None:
            _give_call(layer, *new[1:], owner=owner, model_of=target.obj)
            carry(layer, name, carried.get((id(layer), name)))
            changed = True
    return changed


def _standin_value(mark):
    """``() -> the value of mark's stand-in`` (a read of the variable: TensorFlow's eager custom gradient asks for a
    variable's own gradient)."""

    def standin():
        return chosen().current_value(mark.standin)

    return standin


def _trained_key(frozen: np.ndarray) -> bytes:
    return hashlib.sha1(np.packbits(~np.asarray(frozen, dtype=bool)).tobytes()).digest()


def _same(mark, new) -> bool:
    """Whether the call in place serves ``new`` as it is (the same variable, slice and stand-in)."""
    if mark is None or new is None or mark.variable is not new[2] or (mark.sliced, mark.eligible) != new[3:5]:
        return False
    if mark.holder is not None and mark.trained != _trained_key(new[5]):
        return False  # other trained elements: another stand-in
    return not mark.sliced or mark.slice.key == new[1].key


def _take_call(layer, mark) -> None:
    remove_instance_value(layer, mark_name(layer, mark.variable))
    others = [m for m in (instance_value(layer, name, None) for name in MARKS) if m is not None]
    if not any(m.quantized == mark.quantized for m in others):  # a quantized table's other delta keeps its call
        remove_instance_value(layer, "quantized_call" if mark.quantized else "call")
    if rematerialized(layer) and not others:
        remove_instance_value(layer, "rematerialized_call")
    if mark.holder is not None:
        detach(layer, mark.holder)


def _specs(layer, ks: KernelSlice) -> tuple[str, str, str]:
    """The einsum letters of the layer's input, kernel and output (``Dense``: ``...i,ij->...j``)."""
    if ks.kind == "einsum" or isinstance(layer, keras.layers.EinsumDense):
        x, rest = layer.equation.replace(" ", "").split(",")
        k, y = rest.split("->")
        return x, k, y
    return "...i", "ij", "...j"


def _give_call(layer, ks: KernelSlice, variable, on: bool, eligible: bool, frozen, *, owner, model_of=None) -> None:
    trained = np.flatnonzero(~np.asarray(frozen, dtype=bool))
    reads = padded_index(trained) if ks.kind in SAMPLED_KINDS else None  # what the product of elements reads
    if ks.kind == "sampled":
        taken = Sampled(*_specs(layer, ks), ks.shape, len(trained), reads=reads)
    elif ks.kind == "table elements":
        taken = TableElements(ks.shape, trained)
    else:
        taken = Taken(ks.shape, ks.index, ks.x_axis, ks.y_axis, frozen)
    q = quantized(layer, variable)
    # a stand-in while the layer slices; a kernel held dense (its slice moves often) changes elements without one
    delta = layer.variable_dtype if q else None  # a quantized kernel's: a float delta, zero at first
    holder = attach(layer, variable, trained, index=reads, delta=delta) if on else None
    mark = _Mark(ks, variable, weakref.ref(owner), on, _claims(layer), eligible, holder, _trained_key(frozen), q)
    mark.index = trained if q else None
    plain = type(layer).call.__get__(layer)
    if (
        holder is not None and not q
    ):  # the stand-in goes with the Freezer: the model keeps no variable it would not train
        weakref.finalize(owner, detach, layer, holder)

    def now() -> bool:
        return slicing() and mark.now()

    standin = _standin_value(mark)
    index = (lambda: ops.convert_to_tensor(holder.index)) if ks.kind in SAMPLED_KINDS else (lambda: None)
    if q and isinstance(layer, keras.layers.Embedding):  # its quantized_call reads the parts of each of its marks
        mark.parts = table_parts(layer, ks, taken, standin, index)
    if q:  # Keras runs quantized_call: Keras' product of the integers, plus the delta's
        product = _product(layer, ks)
        call = delta_call(layer, ks, taken, product, standin, index, _bias_and_activation)
        _set_call_marked(layer, "quantized_call", call, mark)
        return
    if ks.kind in ("rows", "table elements"):
        call = _lookup_call(layer, ks, plain, taken, mark, frozen, now, standin, index)
    elif ks.kind in ("dense", "einsum", "sampled"):
        call = _product_call(layer, ks, plain, taken, now, standin, index)
    else:
        call = _conv_call(layer, plain, taken, now, standin)
    _set_call_marked(layer, "call", call, mark)


def _set_call_marked(layer, name: str, call, mark) -> None:
    """Set the layer's ``call`` (or ``quantized_call``) and its mark; under a ``keras.RematScope``, traced anew each call."""
    set_instance_value(layer, name, call)
    if rematerialized(layer):
        set_instance_value(layer, "rematerialized_call", remat_each_call(layer))
    set_instance_value(layer, mark_name(layer, mark.variable), mark)


def _product(layer, ks: KernelSlice):
    """The product ``(x, kernel) -> y`` of a ``Dense`` (a matmul) or ``EinsumDense`` (its equation)."""
    if ks.kind in ("dense", "sampled") and not isinstance(layer, keras.layers.EinsumDense):
        return ops.matmul

    def product(a, k):
        return ops.einsum(layer.equation, a, k)

    return product


def _product_call(layer, ks: KernelSlice, plain, taken, now, standin, index):
    """The call of a ``Dense`` or ``EinsumDense`` whose trained elements get their own gradient."""
    product = _product(layer, ks)

    def call(inputs, training=None):
        if not now():
            return plain(inputs, training=training)
        x = sliced_product(product, inputs, ops.convert_to_tensor(layer.kernel), taken, standin(), index=index())
        return _bias_and_activation(layer, x)

    return call


def _conv_call(layer, plain, taken, now, standin):
    """The call of a convolution whose trained elements get their own gradient (``BaseConv.call`` line for line)."""
    causal = isinstance(layer, keras.layers.Conv1D) and layer.padding == "causal"  # Conv1D.call pads first

    def product(a, k):
        return ops.conv(
            a,
            k,
            strides=list(layer.strides),
            padding="valid" if causal else layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )

    def call(inputs):
        if not now():
            return plain(inputs)
        if causal:
            inputs = ops.pad(inputs, causal_padding(layer))
        outputs = sliced_product(product, inputs, ops.convert_to_tensor(layer.kernel), taken, standin())
        if layer.use_bias:
            if layer.data_format == "channels_last":
                bias_shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                bias_shape = (1, layer.filters) + (1,) * layer.rank
            outputs = ops.add(outputs, ops.reshape(layer.bias, bias_shape))
        if layer.activation is not None:
            return layer.activation(outputs)
        return outputs

    return call


def _lookup_call(layer, ks: KernelSlice, plain, taken, mark, frozen, now, standin, index):
    """The call of an ``Embedding`` (or ``ReversibleEmbedding``) whose trained elements lie in some rows.

    The lookup hands the trained rows' gradient to the stand-in; a tied
    ``ReversibleEmbedding``'s reverse projection (the table as the output
    layer) too: ``dlogits[..., rows]ᵀ · h``, never the table's whole
    gradient. TensorFlow reads the table by rows on every mode (held dense,
    its gradient is Keras' own ``IndexedSlices``).
    """
    reversible = type(layer).call is not keras.layers.Embedding.call  # ReversibleEmbedding: its mask in call
    tf_rows = lookups_are_sparse(layer)
    if ks.kind == "table elements":  # scattered elements: the reverse projection's sampled product
        reads = padded_index(ks.index[0])
        transposed = Sampled("...i", "ij", "...j", ks.shape[::-1], len(ks.index[0]), transposed=True, reads=reads)
    else:
        transposed = Taken(ks.shape[::-1], (None, ks.index[0]), (-1, None), (None, -1), frozen, transposed=True)

    def lookup_call(inputs):
        ids = inputs if inputs.dtype in ("int32", "int64") else ops.cast(inputs, "int32")
        if now():
            outputs = looked_up(layer.embeddings, ids, taken, standin(), index())
        else:
            outputs = read_rows(layer.embeddings, ids)
        outputs = ops.cast(outputs, dtype=layer.compute_dtype)
        mask = keras.layers.Embedding.compute_mask(layer, inputs) if reversible else None
        if mask is not None:
            set_keras_mask(outputs, mask)
        return outputs

    def reverse_call(inputs):
        kernel = ops.transpose(ops.convert_to_tensor(layer.embeddings))
        if layer.reverse_dtype is not None:
            inputs = ops.cast(inputs, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        logits = sliced_product(ops.matmul, inputs, kernel, transposed, standin(), index=index())
        if layer.logit_soft_cap is not None:
            soft_cap = layer.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, soft_cap)), soft_cap)
        return logits

    def call(inputs, **kwargs):
        if kwargs.get("reverse"):
            if now() and getattr(layer, "tie_weights", False):
                return reverse_call(inputs)
            return plain(inputs, **kwargs)
        if now() or (tf_rows and slicing() and mark.live()):
            return lookup_call(inputs)
        return plain(inputs, **kwargs)

    return call


def _bias_and_activation(layer, x):
    """The rest of ``Dense.call`` and ``EinsumDense.call``."""
    if layer.bias is not None:
        x = ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x
