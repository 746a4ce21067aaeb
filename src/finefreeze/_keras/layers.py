"""What finefreeze reads and changes inside Keras layers and models.

A Keras layer keeps its direct sub-layers in ``_layers``, its own weights
in ``_trainable_variables`` and ``_non_trainable_variables`` (``weights``
adds its sub-layers'), walks itself and its sub-layers with
``_flatten_layers``, records the calls that built a functional model in
``_inbound_nodes``, and keeps a ``Dense``'s, ``EinsumDense``'s or
convolution's kernel in ``_kernel`` and an ``Embedding``'s table in
``_embeddings`` (``kernel`` / ``embeddings`` may be a computed view under
LoRA or quantization). Each function below names the one it relies on.
"""

from __future__ import annotations

__all__ = [
    "add_sublayer",
    "all_layers",
    "causal_padding",
    "embeddings_variable",
    "inbound_tensors",
    "is_convolution",
    "kernel_variable",
    "lora_enabled_layers",
    "rematerialized",
    "remat_each_call",
    "module_variables",
    "own_weights",
    "remove_sublayer",
    "seed_generators",
    "set_keras_mask",
    "sublayers",
]


def all_layers(obj, include_self: bool = True) -> list:
    """``obj`` (if ``include_self``) and every layer under it, each once, depth first (``_flatten_layers``)."""
    return list(obj._flatten_layers(include_self=include_self))


def sublayers(layer) -> list:
    """The layers ``layer`` holds directly (``_layers``), or ``[]`` for an object that holds none."""
    return list(getattr(layer, "_layers", None) or ())


def add_sublayer(layer, sub) -> None:
    """Make ``sub`` a sub-layer of ``layer``: in its ``weights``, walks and saving.

    Relies on: ``Layer.weights`` and ``_flatten_layers`` read ``_layers``.
    """
    layer._layers.append(sub)


def remove_sublayer(layer, sub) -> None:
    """Take ``sub`` out of ``layer``'s sub-layers (see :func:`add_sublayer`); absent: nothing."""
    if sub in layer._layers:
        layer._layers.remove(sub)


def own_weights(layer) -> tuple[list, list]:
    """``(trainable, non-trainable)`` weights ``layer`` made itself, not its sub-layers'.

    Relies on: ``add_weight`` appends to ``_trainable_variables`` or
    ``_non_trainable_variables`` by the ``trainable`` it is given
    (``weights`` is both plus the sub-layers').
    """
    return list(layer._trainable_variables), list(layer._non_trainable_variables)


def inbound_tensors(layer) -> list:
    """The input tensors of every call that built ``layer`` into a functional model (``_inbound_nodes``)."""
    import keras

    return [t for node in layer._inbound_nodes for t in keras.tree.flatten(node.input_tensors)]


def seed_generators(layer) -> list:
    """The ``SeedGenerator`` objects ``layer`` made itself (Dropout's and friends': ``_seed_generators``)."""
    return list(getattr(layer, "_seed_generators", None) or ())


def lora_enabled_layers(layer) -> list:
    """The layers KerasHub's ``enable_lora`` switched to LoRA under ``layer`` (``_lora_enabled_layers``), or []."""
    return list(getattr(layer, "_lora_enabled_layers", None) or ())


def rematerialized(layer) -> bool:
    """Whether Keras rematerializes ``layer``'s call: it was made in a ``keras.RematScope`` (``_remat_mode``)."""
    return getattr(layer, "_remat_mode", None) is not None


def remat_each_call(layer):
    """A ``rematerialized_call`` for ``layer`` that hands Keras a new function at every call.

    Keras rematerializes ``layer.call``, a bound method: a new object at
    every call. A call set on the instance is one function for as long as
    it is set, and JAX caches the trace of a checkpointed function by the
    function: the next trace (the train step after the symbolic build)
    would reuse the first one's values as constants, its variables'
    tracers, and a stand-in would get no gradient. A new wrapper per call
    is traced anew, as Keras' own call is.
    """
    keras_call = type(layer).rematerialized_call

    def rematerialized_call(layer_call, *args, **kwargs):
        def each_call(*a, **k):
            return layer_call(*a, **k)

        return keras_call(layer, each_call, *args, **kwargs)

    return rematerialized_call


def kernel_variable(layer):
    """The variable a ``Dense``, ``EinsumDense`` or convolution holds as its kernel (``_kernel``), or None."""
    return getattr(layer, "_kernel", None)


def embeddings_variable(layer):
    """The table an ``Embedding`` holds (``_embeddings``), or None."""
    return getattr(layer, "_embeddings", None)


def is_convolution(layer, plain: bool = False) -> bool:
    """Whether ``layer`` is one of Keras' convolutions (a ``BaseConv``: ``Conv1D``, ``Conv2D``, ``Conv3D``).

    ``plain``: and it computes as ``BaseConv`` does (its ``call`` and
    ``convolution_op`` are ``BaseConv``'s, or ``Conv1D``'s causal ``call``),
    not a subclass's own (a transposed or depthwise convolution).
    """
    import keras
    from keras.src.layers.convolutional.base_conv import BaseConv

    if not isinstance(layer, BaseConv):
        return False
    return not plain or (
        type(layer).call in (BaseConv.call, keras.layers.Conv1D.call)
        and type(layer).convolution_op is BaseConv.convolution_op
    )


def causal_padding(layer):
    """The padding ``Conv1D(padding="causal")`` puts before its inputs (``_compute_causal_padding``)."""
    return layer._compute_causal_padding()


def set_keras_mask(outputs, mask) -> None:
    """Give ``outputs`` Keras' mask, as a layer's own call does (``keras.src.backend.set_keras_mask``)."""
    from keras.src.backend import set_keras_mask as set_mask

    set_mask(outputs, mask)


def module_variables(module, is_variable) -> list:
    """``(path, variable)`` of every variable a ``tf.Module`` holds, found by TensorFlow's walk (``_flatten``)."""
    return list(module._flatten(predicate=is_variable, with_path=True))
