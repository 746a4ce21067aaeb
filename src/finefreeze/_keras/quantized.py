"""What finefreeze reads of Keras' quantized layers, and Keras' quantized product without bias or activation.

``layer.quantize("int8")`` (or ``"int4"``) replaces a ``Dense`` or
``EinsumDense`` kernel by a non-trainable integer variable ``_kernel``
(int4: two values packed per byte along the last axis), with
``kernel_scale`` (and int4's ``kernel_zero`` and ``g_idx`` for sub-channel
blocks) beside it; ``Layer.__call__`` then runs ``quantized_call``, which
dispatches to ``_int8_call`` / ``_int4_call``. Those compute the product,
add LoRA (when enabled), then the bias and the activation. Each function
below names the one it relies on.
"""

from __future__ import annotations

__all__ = [
    "FLOAT8_STATISTICS",
    "QUANTIZED_KINDS",
    "is_quantized",
    "logical_shape",
    "quantized_lookup",
    "quantized_product",
    "quantized_values",
    "reverse_table",
]

#: the quantization modes whose kernels a plan may train a part of (a float delta beside the kernel)
QUANTIZED_KINDS = ("int8", "int4")

#: the variables ``quantize("float8")`` adds to a ``Dense`` / ``EinsumDense`` (each ``overwrite_with_gradient``)
FLOAT8_STATISTICS = frozenset(
    f"{part}_{kind}" for part in ("inputs", "kernel", "outputs_grad") for kind in ("scale", "amax_history")
)


def is_quantized(layer) -> str | None:
    """The quantization mode of a ``Dense``, ``EinsumDense`` or ``Embedding`` layer (``quantization_mode``), or None."""
    import keras

    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding)):
        return None
    return getattr(layer, "quantization_mode", None)


def reverse_table(layer):
    """The untied output table of a quantized ``ReversibleEmbedding`` (``reverse_embeddings``), or None.

    Relies on: ``quantize`` gives an untied ``ReversibleEmbedding`` a
    non-trainable ``reverse_embeddings`` of integers (int4: two packed per
    byte along its first axis) and a ``reverse_embeddings_scale``.
    """
    if getattr(layer, "tie_weights", True) or getattr(layer, "quantization_mode", None) is None:
        return None
    return getattr(layer, "reverse_embeddings", None)


def logical_shape(layer, variable=None) -> tuple[int, ...]:
    """The float kernel's shape of a quantized layer (or of ``variable``, its untied output table), whatever the packing.

    Relies on: int8 keeps the kernel's shape; int4 packs the last axis of a
    ``Dense`` kernel (``_orig_output_dim``) and an ``EinsumDense``'s 2-D
    view of it (``original_kernel_shape``).
    """
    import keras

    if isinstance(layer, keras.layers.Embedding):  # int4 packs each row (the output table: each column)
        if variable is not None and variable is reverse_table(layer):
            return (int(layer.output_dim), int(layer.input_dim))
        return (int(layer.input_dim), int(layer.output_dim))
    kernel = layer._kernel
    if layer.quantization_mode != "int4":
        return tuple(int(d) for d in kernel.shape)
    if hasattr(layer, "original_kernel_shape"):
        return tuple(int(d) for d in layer.original_kernel_shape)
    return (int(kernel.shape[0]), int(layer._orig_output_dim))


def quantized_values(layer, variable=None) -> list:
    """The variables that hold a quantized kernel's values: ``_kernel`` and its scale, zero point and group index.

    Relies on: ``kernel_scale``, ``kernel_zero`` (int4 sub-channel) and
    ``g_idx`` are attributes of the layer (an ``Embedding``'s:
    ``_embeddings``, ``embeddings_scale``, ``embeddings_zero``, ``g_idx``;
    its untied output table, ``variable``: ``reverse_embeddings``,
    ``reverse_embeddings_scale`` and ``reverse_embeddings_zero``).
    """
    import keras

    if variable is not None and variable is reverse_table(layer):
        own = [getattr(layer, n, None) for n in ("reverse_embeddings_scale", "reverse_embeddings_zero")]
        return [variable] + [v for v in own if v is not None and hasattr(v, "assign")]
    if isinstance(layer, keras.layers.Embedding):
        out = [layer._embeddings]
        names = ("embeddings_scale", "embeddings_zero", "g_idx")
    else:
        out = [layer._kernel]
        names = ("kernel_scale", "kernel_zero", "g_idx")
    for name in names:
        v = getattr(layer, name, None)
        if v is not None and hasattr(v, "assign"):
            out.append(v)
    return out


class _Bare:
    """The layer, read through, with no bias and no activation: Keras' quantized call then stops at the product."""

    bias = None
    activation = None
    logit_soft_cap = None  # a ReversibleEmbedding's reverse projection: capped after the delta's logits

    def __init__(self, layer):
        self.__dict__["_layer"] = layer

    def __getattr__(self, name):
        return getattr(self.__dict__["_layer"], name)


def quantized_product(layer, inputs, **kwargs):
    """Keras' quantized product of ``layer`` (LoRA included, when enabled), before its bias and activation.

    A ``ReversibleEmbedding``'s reverse projection (``reverse=True``) stops
    before its logits' soft cap.

    Relies on: ``_int8_call`` / ``_int4_call`` read ``self.bias``,
    ``self.activation`` and ``self.logit_soft_cap`` as attributes and apply
    them last.
    """
    call = getattr(type(layer), f"_{layer.quantization_mode}_call")
    return call(_Bare(layer), inputs, **kwargs)


def quantized_lookup(layer, ids):
    """Keras' quantized lookup of an ``Embedding`` (or ``ReversibleEmbedding``): the rows of ``ids``, dequantized.

    Relies on: ``Embedding._int8_call`` / ``_int4_call`` are the lookup
    (``ReversibleEmbedding``'s dispatch to them with ``super()``).
    """
    import keras

    return getattr(keras.layers.Embedding, f"_{layer.quantization_mode}_call")(_Bare(layer), ids)
