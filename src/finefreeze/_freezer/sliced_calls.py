"""Layers whose trained kernel slice gets its own weight gradient: their ``call``, set on the instance.

For each partially frozen kernel :func:`finefreeze._enforce.slices.kernel_slice`
finds a block for, the layer gets a ``call`` of its own instance (in its
``__dict__``, as Python looks there first): Keras' call of that class line
for line (``Dense``, ``EinsumDense``, the convolutions, ``Embedding`` and
``ReversibleEmbedding``'s lookup), with
the kernel product (an embedding's lookup) replaced by
:func:`finefreeze._backends.slices.sliced_product`. Nothing of it is saved:
the layer keeps its class and its config, and a model saved while it trains
loads as plain Keras. A layer that two live Freezers plan (two plans
trained by turns, as a GAN's) is never sliced: the gradient the layer
computes cannot know which plan's optimizer will apply it. The call falls
back to the class's own when the Freezer that set it is gone, inside
:func:`finefreeze._backends.slices.full_gradients` (``select``
scores every element) and when the Freezer's ``gradients="dense"``.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import keras
from keras import ops
from keras.src.backend import set_keras_mask

from finefreeze._backends.questions import keras_backend
from finefreeze._backends.slices import Sampled, Taken, looked_up, sliced_product, slicing
from finefreeze._enforce.slices import MARK, KernelSlice, choose
from finefreeze._optimizer.wrapper import FreezingOptimizer
from finefreeze._resolve.resolve import PARTIAL

__all__ = ["set_sliced"]

#: the attribute of a layer holding (weakly) every Freezer that planned it: two live ones keep it dense
CLAIMS = "_finefreeze_claims"


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

    def live(self) -> bool:
        """The Freezer that set the call lives and is the only one planning the layer."""
        return self.owner() is not None and len(self.claims) == 1

    def now(self) -> bool:
        """Whether the call computes the slice's gradient only, were it traced now."""
        return self.sliced and self.live() and not _watched(self)


def _watched(mark) -> bool:
    """``gradients="auto"`` while the frozen gradient's norm is recorded (FreezeBoard): the dense gradient.

    TensorFlow's rows are the exception: their gradient holds every row of the batch either way.
    """
    frz = mark.owner()
    if frz is None or frz.gradients != "auto" or (mark.slice.kind == "rows" and keras_backend() == "tensorflow"):
        return False
    return any(getattr(o, "recording_norms", False) for o in frz.optimizers())


def set_sliced(target, res, owner, mode: str = "sliced", held: set | None = None, often: bool = False) -> bool:
    """Give every layer of ``target`` the call ``res`` asks for; return whether any call changed.

    Args:
        target: the collected target.
        res: the resolution in force.
        owner: the Freezer (held weakly: once it is gone, the layers compute dense gradients).
        mode: the Freezer's ``gradients``. ``"dense"``: no layer is sliced (on
            TensorFlow a partially frozen ``Embedding`` still reads its table
            by rows, which changes no maths: the gradient is Keras' own);
            ``"sliced"``: every slice (or sampled kernel) :func:`~finefreeze._enforce.slices.choose`
            finds; ``"auto"``: those :func:`~finefreeze._enforce.slices.pays` says pay, but not the
            paths in ``held``.
        held: ``"auto"``: paths kept dense.
        often: the plan changes again soon (``Reselect``): under ``"auto"`` a
            sliced kernel whose slice moves joins ``held`` (the dense path
            changes masks without a retrace; a moved slice retraces the step).
    """
    if target.kind != "keras":
        return False
    held = set() if held is None else held
    marks = {id(layer): layer.__dict__.get(MARK) for layer in target.layers if hasattr(layer, "__dict__")}
    want = {}
    for s in res.states:
        if s.state == PARTIAL and s.info.is_keras and s.info.owner is not None:
            ks, eligible = choose(s.info.owner, s.variable, s.mask.dense(), mode)
            on = eligible and not (mode == "auto" and s.path in held)
            old = marks.get(id(s.info.owner))
            if mode == "auto" and often and on and old is not None and old.sliced and old.variable is s.variable:
                if old.slice.key != ks.key:  # the slice moved and will move again: the dense path from now on
                    held.add(s.path)
                    on = False
            # TensorFlow's table read by rows changes no maths: it is the dense path too
            if ks is not None and (eligible or (ks.kind == "rows" and keras_backend() == "tensorflow")):
                want[id(s.info.owner)] = (s.info.owner, ks, s.variable, on, eligible)
    layers = [layer for layer in target.layers if hasattr(layer, "__dict__")]
    for layer in layers:
        layer.__dict__.setdefault(CLAIMS, weakref.WeakSet()).add(owner)
    if any(len(layer.__dict__[CLAIMS]) > 1 for layer in layers if id(layer) in want):
        gc.collect()  # a Freezer dropped in a reference cycle is not another plan
    for layer in layers:  # another live Freezer plans this layer: which plan's optimizer trains is not known
        if len(layer.__dict__[CLAIMS]) > 1:
            want.pop(id(layer), None)
    changed = False
    for layer in layers:
        mark = layer.__dict__.get(MARK)
        new = want.get(id(layer))
        same = mark is not None and new is not None and mark.variable is new[2]
        same = same and (mark.sliced, mark.eligible) == new[3:] and (not mark.sliced or mark.slice.key == new[1].key)
        if same:  # a kernel held dense keeps Keras' call whatever its slice: no retrace when the slice moves
            mark.owner, mark.slice = weakref.ref(owner), new[1]
            continue
        if mark is not None:
            del layer.__dict__["call"], layer.__dict__[MARK]
            changed = True
        if new is not None:
            _give_call(layer, new[1], new[2], owner, new[3], target.obj, new[4])
            changed = True
    return changed


def _give_call(layer, ks: KernelSlice, variable, owner, on: bool, model_of=None, eligible: bool = True) -> None:
    if ks.kind == "sampled":
        taken = Sampled(ks.shape, *ks.index)
    else:
        taken = Taken(ks.shape, ks.index, ks.x_axis, ks.y_axis)
    mark = _Mark(ks, variable, weakref.ref(owner), on, layer.__dict__[CLAIMS], eligible)
    plain = type(layer).call.__get__(layer)
    tf_rows = ks.kind == "rows" and keras_backend() == "tensorflow"  # read by rows on every mode

    def sliced() -> bool:
        return slicing() and (mark.live() if tf_rows else mark.now())

    if ks.kind in ("dense", "sampled"):

        def call(inputs, training=None):
            if not sliced():
                return plain(inputs, training=training)
            x = sliced_product(ops.matmul, inputs, ops.convert_to_tensor(layer.kernel), taken)
            return _bias_and_activation(layer, x)

    elif ks.kind == "rows":
        reversible = type(layer).call is not keras.layers.Embedding.call  # ReversibleEmbedding: its mask in call
        model = weakref.ref(model_of) if model_of is not None else (lambda: None)

        def call(inputs, **kwargs):
            if not sliced() or kwargs.get("reverse"):  # reverse: the table as the output projection, Keras' own
                return plain(inputs, **kwargs)
            # a LossScaleOptimizer (mixed precision, or compiled around the wrapper) checks every gradient
            # densely, which PyTorch's sparse one cannot be: it gets a dense one; so does a custom loop under
            # gradients="auto" (the model is not compiled with the wrapper), whose own code may not take one
            compiled = getattr(model(), "optimizer", None)
            loop = mark.owner() is not None and mark.owner().gradients == "auto"
            loop = loop and not isinstance(compiled, FreezingOptimizer)
            scaled = isinstance(compiled, keras.optimizers.LossScaleOptimizer)
            taken.sparse_rows = (
                not (scaled or loop) and layer.dtype_policy.compute_dtype == layer.dtype_policy.variable_dtype
            )
            ids = inputs if inputs.dtype in ("int32", "int64") else ops.cast(inputs, "int32")
            outputs = ops.cast(looked_up(layer.embeddings, ids, taken), dtype=layer.compute_dtype)
            mask = keras.layers.Embedding.compute_mask(layer, inputs) if reversible else None
            if mask is not None:
                set_keras_mask(outputs, mask)
            return outputs

    elif ks.kind == "einsum":

        def product(a, k):
            return ops.einsum(layer.equation, a, k)

        def call(inputs, training=None):
            if not sliced():
                return plain(inputs, training=training)
            x = sliced_product(product, inputs, ops.convert_to_tensor(layer.kernel), taken)
            return _bias_and_activation(layer, x)

    else:
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
            if not sliced():
                return plain(inputs)
            if causal:
                inputs = ops.pad(inputs, layer._compute_causal_padding())
            outputs = sliced_product(product, inputs, ops.convert_to_tensor(layer.kernel), taken)
            if layer.use_bias:
                if layer.data_format == "channels_last":
                    bias_shape = (1,) * (layer.rank + 1) + (layer.filters,)
                else:
                    bias_shape = (1, layer.filters) + (1,) * layer.rank
                outputs = ops.add(outputs, ops.reshape(layer.bias, bias_shape))
            if layer.activation is not None:
                return layer.activation(outputs)
            return outputs

    layer.__dict__["call"] = call
    layer.__dict__[MARK] = mark


def _bias_and_activation(layer, x):
    """The rest of ``Dense.call`` and ``EinsumDense.call``."""
    if layer.bias is not None:
        x = ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x
