"""Stand-ins: the trained elements of a partially frozen kernel as a trainable variable of their own.

Keras computes gradients for the variables a model trains, each in its
variable's shape: a kernel of which 1 % trains would get a kernel-shaped
gradient. A sliced layer (``_slices.calls``) hands the gradient of the
kernel's trained elements to a *stand-in* instead, a flat variable of those
elements alone in sorted flat order, and the kernel gets none. The
optimizer updates the stand-in (it is ``compact``'s vector: the inner
optimizer's state is made for it) and writes it back into the kernel in
place; before each update the stand-in is refilled from the kernel, so a
kernel written outside training (``load_weights``, a checkpoint) is what
trains on.

A stand-in lives in a small layer (:class:`TrainedElements`) held in the
kernel's layer's sublayers, so that every Keras trainer (which asks the
model for its trainable variables) computes its gradient. It is not an
attribute of the layer: a saved model holds no trace of it and loads as
plain Keras, and the optimizer saves it where ``compact``'s vector always
was. It goes when its Freezer goes or stops slicing the layer.
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import numpy as np

from finefreeze._backends.distribute import owner_scope
from finefreeze._backends.variables import eager_scope, host_initializer
from finefreeze._keras.layers import add_sublayer, remove_sublayer

__all__ = [
    "TrainedElements",
    "attach",
    "detach",
    "held",
    "is_standin",
    "is_standin_layer",
    "kernel_named",
    "kernel_of",
    "standin_note",
]

#: id of each live stand-in -> (weak reference to it, weak reference to its kernel)
_KERNELS: dict[int, tuple] = {}
#: id of each variable a stand-in's layer holds (its values and index) -> weak reference to it
_HELD: dict[int, object] = {}


def _forget(key: int):
    """The weak reference callback that drops ``key`` from :data:`_HELD`."""
    return lambda _: _HELD.pop(key, None)


def held(variable) -> bool:
    """Whether ``variable`` is one a stand-in's layer holds (its values or its index): not one of the model's own."""
    ref = _HELD.get(id(variable))
    return ref is not None and ref() is variable


def kernel_of(variable):
    """The kernel whose trained elements ``variable`` stands in for, or None (not a stand-in)."""
    entry = _KERNELS.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return None
    return entry[1]()


def kernel_named(path: str, kernels) -> object | None:
    """The kernel among ``kernels`` that a live stand-in named ``path`` (its values or its index) stands for."""
    ids = {id(k) for k in kernels}
    for standin_ref, kernel_ref in list(_KERNELS.values()):
        standin, kernel = standin_ref(), kernel_ref()
        if standin is None or kernel is None or id(kernel) not in ids:
            continue
        holder = standin.path.rsplit("/", 1)[0]
        if path in (standin.path, f"{holder}/index"):
            return kernel
    return None


def standin_note(path: str, kernels) -> str:
    """`` (...)``: what a stand-in named ``path`` stands for, for an error message; "" if no stand-in has that path."""
    kernel = kernel_named(path, kernels)
    if kernel is None:
        return ""
    return (
        f"; {path!r} is the stand-in of {kernel.path!r} (shape {tuple(kernel.shape)}): its trained elements as a "
        "variable of their own, which a Freezer adds for gradients='sliced' and which plans pass over. "
        f"Ask for {kernel.path!r}"
    )


def is_standin(variable) -> bool:
    """Whether ``variable`` is a stand-in (plans, targets and layouts pass over it)."""
    return kernel_of(variable) is not None


class TrainedElements(keras.layers.Layer):
    """A layer holding one stand-in: ``values``, the trained elements of ``variable`` (flat indices ``trained``).

    With ``index``, also a non-trainable variable ``index`` of those
    indices as the sampled product reads them in the step (an index the
    step reads as a constant would be compiled into the program).

    Args:
        variable: the partially frozen kernel.
        trained: the sorted flat indices of its trained elements.
        name: the layer's name.
        index: the flat indices the sampled product reads (``trained``
            padded to its chunks), or None.
        delta: a quantized kernel's: the dtype of the float delta it holds
            instead of the trained elements' values (zero at first).
    """

    def __init__(
        self, variable, trained: np.ndarray, name: str, index: np.ndarray | None = None, delta: str | None = None
    ):
        dtype = delta or variable.dtype
        super().__init__(name=name, trainable=True, dtype=dtype)
        if delta is not None:  # a quantized kernel's trained part: a float delta, zero at first
            values = np.zeros(len(trained), dtype=keras.backend.standardize_dtype(dtype))
        else:
            with eager_scope():
                values = np.asarray(keras.ops.convert_to_numpy(variable)).reshape(-1)[trained]
        self._of = weakref.ref(variable)  # a weak reference: Keras would track a variable as this layer's own
        self.delta = delta is not None
        self.values = self.add_weight(
            shape=values.shape,
            dtype=dtype,
            initializer=host_initializer(values),
            trainable=True,
            name="values",
        )
        self.index = None
        if index is not None:
            size = max(int(np.prod(variable.shape, dtype=np.int64)), int(trained[-1]) + 1 if len(trained) else 0)
            flat = np.asarray(index).astype(np.int32 if size <= np.iinfo(np.int32).max + 1 else np.int64)
            self.index = self.add_weight(
                shape=flat.shape,
                dtype=str(flat.dtype),
                initializer=host_initializer(flat),
                trainable=False,
                name="index",
            )
        self.built = True
        key = id(self.values)
        _KERNELS[key] = (weakref.ref(self.values, lambda _: _KERNELS.pop(key, None)), weakref.ref(variable))
        for w in (self.values, self.index):
            if w is not None:
                _HELD[id(w)] = weakref.ref(w, _forget(id(w)))

    @property
    def of(self):
        """The kernel whose trained elements this holds (None once it is gone)."""
        return self._of()

    def call(self, inputs):  # never called: it only holds the variable
        return inputs


def is_standin_layer(layer) -> bool:
    """Whether ``layer`` only holds a stand-in (targets, reports and plans pass over it)."""
    return isinstance(layer, TrainedElements)


def attach(
    layer, variable, trained: np.ndarray, index: np.ndarray | None = None, delta: str | None = None
) -> TrainedElements:
    """A stand-in of ``variable``'s trained elements, held by ``layer`` (made in the variable's distribution scope).

    ``delta``: a quantized kernel's stand-in, a float delta of this dtype (see :class:`TrainedElements`).
    """
    name = f"{variable.name}_trained"
    with owner_scope([variable]), contextlib.ExitStack() as scopes:
        for part in layer.path.split("/"):  # its path is the layer's: ``layer/kernel_trained/values``
            scopes.enter_context(keras.name_scope(part))
        holder = TrainedElements(variable, np.asarray(trained, dtype=np.int64), name=name, index=index, delta=delta)
    add_sublayer(layer, holder)
    return holder


def detach(layer, holder: TrainedElements) -> None:
    """Take the stand-in ``holder`` out of ``layer``."""
    remove_sublayer(layer, holder)
