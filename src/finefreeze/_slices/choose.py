"""Which partially frozen kernels train a slice, and the block a slice's weight gradient covers.

A kernel of a ``Dense``, ``EinsumDense`` (the attention projections of
Keras and KerasHub) or ``Conv1D/2D/3D`` layer whose trained elements lie in
a block (some rows, columns, output or input channels, heads: indices along
some of its axes) gets the weight gradient of that block only
(:func:`finefreeze._slices.product.sliced_product`); so does the table of
an ``Embedding`` (or ``ReversibleEmbedding``, KerasHub's token embedding)
whose trained elements lie in some rows (new tokens): the gradient of those
rows only, summed from the batch's ids. The block is the
smallest one holding every trained element: along each axis the kernel's
product runs over, the indices where something trains. A plan of index
suffixes (``"d/kernel[:, :10]"``), a ``mask=`` of whole rows or columns or a
plan ``select`` made all give blocks; trained elements scattered over every
row and column give none (the whole kernel). Elements of the block that are
frozen get a gradient as before, and their strategy keeps them frozen.

A ``Dense`` kernel whose few trained elements lie in no small block
(scattered, as a ``select`` at a small budget picks them) can get the
*sampled product* instead (:func:`kernel_sample`): the gradient at those
elements only, ``sum(x[:, i] * dy[:, j])`` per trained ``(i, j)``, which
pays below a few tenths of a percent of a kernel (:data:`AUTO_SAMPLES`).
An embedding table's scattered elements (at most :data:`SAMPLE_AT_MOST`
of it, in rows that are more than that) get the lookup's gradient at
them alone (``"table elements"``): the rows' block would be most of the
table.

Only layers whose ``call`` is Keras' own are sliced (a subclass with a call
of its own keeps the dense path), without LoRA or quantization, and
convolutions with ``groups=1``. A layer made in a ``keras.RematScope`` is
sliced too: Keras recomputes its call, stand-in included, in the backward
pass (``_keras.layers.remat_each_call``).

A kernel Keras quantized (``int8``, ``int4``) has no dense path: what
trains of it is a float delta of its trained elements beside the integers
(``_slices.quantized``), always on its block or its elements, whatever
the gradients mode.

Example:
    >>> import keras, numpy as np
    >>> from finefreeze._slices.choose import kernel_slice
    >>> d = keras.layers.Dense(8); d.build((None, 4))
    >>> frozen = np.ones((4, 8), bool); frozen[:, :2] = False
    >>> s = kernel_slice(d, d.kernel, frozen)
    >>> s.index[1].tolist(), s.fraction
    ([0, 1], 0.25)
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from finefreeze._backends.costs import AUTO_PAYS, AUTO_SAMPLES, MEMORY_AT, auto_pays, auto_samples
from finefreeze._keras.instances import instance_value
from finefreeze._keras.layers import embeddings_variable, is_convolution, kernel_variable
from finefreeze._keras.quantized import QUANTIZED_KINDS, is_quantized, logical_shape, reverse_table
from finefreeze._resolve.axes import einsum_axes

__all__ = [
    "AUTO_PAYS",
    "AUTO_SAMPLES",
    "MARK",
    "MARKS",
    "REVERSE_MARK",
    "SAMPLED_KINDS",
    "SAMPLE_AT_MOST",
    "SLICE_AT_MOST",
    "KernelSlice",
    "exact_block",
    "choose",
    "kernel_sample",
    "kernel_shape",
    "kernel_slice",
    "mark_name",
    "mark_of",
    "pays",
    "quantized",
    "slice_eligible",
    "sampled_equation",
    "sliced_gradient",
    "standin_of",
]

#: the attribute (in the layer's ``__dict__``) of a layer whose call computes a block's weight gradient only
MARK = "_finefreeze_sliced"

#: the attribute of a quantized untied ``ReversibleEmbedding`` holding its output table's mark (the table's: MARK)
REVERSE_MARK = "_finefreeze_sliced_reverse"

#: every attribute a layer's marks may be in
MARKS = (MARK, REVERSE_MARK)

#: a block of at most this fraction of its kernel gets its own weight gradient (docs/benchmarks.md)
SLICE_AT_MOST = 0.5

#: the kinds of :class:`KernelSlice` that list elements, not a block
SAMPLED_KINDS = ("sampled", "table elements")

#: ``gradients="sliced"``: the largest fraction of a ``Dense`` or ``EinsumDense`` kernel whose scattered trained
#: elements get the sampled product; it is the memory choice (no kernel-shaped gradient), slower than the whole
#: product from about 1 % on JAX and PyTorch on a CPU
SAMPLE_AT_MOST = 0.05


@dataclasses.dataclass(frozen=True, eq=False)
class KernelSlice:
    """The block of a kernel whose weight gradient is computed, and how the layer's product runs over it.

    ``index[i]``: the block's sorted indices along kernel axis ``i`` (None: the
    whole axis); ``x_axis[i]`` / ``y_axis[i]``: the axis of the layer's input /
    output that kernel axis ``i`` is contracted with / becomes (None: neither).
    A ``"sampled"`` or ``"table elements"`` one lists elements, not a block:
    ``index`` is ``(sorted flat indices of the trained elements,)``.
    """

    # "dense" | "einsum" | "conv" | "rows" (an embedding's rows) | "sampled" (a Dense kernel's elements)
    # | "table elements" (an embedding table's scattered elements)
    kind: str
    shape: tuple[int, ...]
    index: tuple[np.ndarray | None, ...]
    x_axis: tuple[int | None, ...]
    y_axis: tuple[int | None, ...]

    @property
    def size(self) -> int:
        if self.kind in SAMPLED_KINDS:
            return len(self.index[0])
        return int(np.prod([n if i is None else len(i) for n, i in zip(self.shape, self.index)], dtype=np.int64))

    @property
    def fraction(self) -> float:
        return self.size / float(np.prod(self.shape, dtype=np.int64))

    @property
    def key(self) -> tuple:
        """Equal for equal blocks (a changed block means a new product: the step is traced again)."""
        return (self.kind, self.shape) + tuple(None if i is None else i.tobytes() for i in self.index)


def quantized(layer, variable) -> bool:
    """Whether ``variable`` is the kernel (or table) of a layer Keras quantized to a mode a plan may train a part of."""
    own = kernel_variable(layer) is variable or embeddings_variable(layer) is variable
    own = own or (variable is not None and reverse_table(layer) is variable)
    return own and is_quantized(layer) in QUANTIZED_KINDS


def mark_name(layer, variable) -> str:
    """The attribute of ``layer`` holding the mark of ``variable``'s call: a quantized untied output table has its own."""
    return REVERSE_MARK if variable is not None and reverse_table(layer) is variable else MARK


def mark_of(layer, variable):
    """The mark of the call that computes ``variable``'s trained elements (of ``layer``), or None."""
    mark = instance_value(layer, mark_name(layer, variable), None)
    return mark if mark is not None and mark.variable is variable else None


def kernel_shape(layer, variable) -> tuple[int, ...]:
    """The kernel's shape as plans see it: a quantized kernel's float shape, whatever its packing."""
    if quantized(layer, variable):
        return logical_shape(layer, variable)
    return tuple(int(d) for d in variable.shape)


def _geometry(layer, variable):
    """``(kind, x_axis, y_axis)`` of a kernel whose layer can be sliced, else None."""
    mode = getattr(layer, "quantization_mode", None)
    if mode is not None and not quantized(layer, variable):
        return None
    if getattr(layer, "lora_enabled", False) and mode is None:
        return None
    call, rank = type(layer).call, len(kernel_shape(layer, variable))
    if mode is not None and reverse_table(layer) is variable:  # the logits' product: h (..., hidden) times it
        return "dense", (-1, None), (None, -1)
    lookups = (keras.layers.Embedding.call, getattr(getattr(keras.layers, "ReversibleEmbedding", None), "call", None))
    if call in lookups and embeddings_variable(layer) is variable and rank == 2:
        return "rows", (0, None), (None, None)  # rows looked up by the ids, each whole
    if kernel_variable(layer) is not variable or rank < 2:
        return None
    if call is keras.layers.Dense.call and rank == 2:
        return "dense", (-1, None), (None, -1)
    if call is keras.layers.EinsumDense.call:
        axes = einsum_axes(layer.equation, rank)
        return None if axes is None else ("einsum", *axes)
    if is_convolution(layer, plain=True) and getattr(layer, "groups", 1) == 1:
        channel = -1 if layer.data_format == "channels_last" else 1
        spatial = (None,) * (rank - 2)
        return "conv", spatial + (channel, None), spatial + (None, channel)
    return None


def kernel_slice(layer, variable, frozen: np.ndarray, at_most: float = SLICE_AT_MOST) -> KernelSlice | None:
    """The block of ``variable`` (a kernel of ``layer``) that holds its trained elements, when slicing pays.

    Args:
        layer: the variable's owner.
        variable: the kernel.
        frozen: its frozen-element mask (True = frozen).
        at_most: the largest fraction of the kernel the block may be (1: any block, the whole kernel too).

    Returns:
        The :class:`KernelSlice`, or None: not a kernel finefreeze slices, or
        the block is more than ``at_most`` of the kernel.
    """
    geometry = _geometry(layer, variable)
    if geometry is None:
        return None
    kind, x_axis, y_axis = geometry
    trained = ~np.asarray(frozen, dtype=bool)
    index = []
    for axis in range(trained.ndim):
        if x_axis[axis] is None and y_axis[axis] is None:
            index.append(None)
            continue
        along = trained.any(axis=tuple(a for a in range(trained.ndim) if a != axis))
        idx = np.flatnonzero(along).astype(np.int32)
        index.append(None if len(idx) == len(along) else idx)
    if all(i is None for i in index) and at_most < 1:
        return None
    s = KernelSlice(kind, kernel_shape(layer, variable), tuple(index), x_axis, y_axis)
    return s if 0 < s.fraction <= at_most else None


def kernel_sample(layer, variable, frozen: np.ndarray, at_most: float = SAMPLE_AT_MOST) -> KernelSlice | None:
    """The trained elements of a ``Dense`` or ``EinsumDense`` kernel or an embedding's table, at most
    :data:`SAMPLE_AT_MOST` of it, for the gradient of those elements alone.

    A table's elements (``"table elements"``) get the lookup's gradient at
    them (and a tied table's reverse projection the sampled product).

    An ``EinsumDense`` kernel qualifies when each of its axes is contracted
    with the input or becomes an output axis (not both), and every other
    input axis is an output axis too: each trained element is then a column
    of the input and one of the output gradient.

    Args:
        layer: the variable's owner.
        variable: the kernel.
        frozen: its frozen-element mask (True = frozen).
        at_most: the largest fraction of the kernel its trained elements may be.

    Returns:
        A ``"sampled"`` (or ``"table elements"``) :class:`KernelSlice`
        (``index``: the sorted flat indices of the trained elements), or
        None: not such a kernel, nothing trained, or more than
        :data:`SAMPLE_AT_MOST`.
    """
    geometry = _geometry(layer, variable)
    if geometry is None or geometry[0] not in ("dense", "einsum", "rows"):
        return None
    if geometry[0] == "einsum" and not sampled_equation(layer.equation):
        return None
    frozen = np.asarray(frozen, dtype=bool)
    n = frozen.size - int(np.count_nonzero(frozen))  # no copy of the mask: most kernels are not sampled
    if n == 0 or n > at_most * frozen.size:
        return None
    flat = np.flatnonzero(~frozen.reshape(-1)).astype(np.int64)
    kind = "table elements" if geometry[0] == "rows" else "sampled"
    return KernelSlice(kind, kernel_shape(layer, variable), (flat,), *geometry[1:])


def sampled_equation(equation: str) -> bool:
    """Whether an ``EinsumDense`` equation lets the sampled product take its kernel's elements one by one."""
    try:
        ins, y = equation.replace(" ", "").split("->")
        x, k = ins.split(",")
    except ValueError:
        return False
    if "..." in k or x.count("...") != y.count("...") or len(set(k)) != len(k):
        return False
    xs, ys = set(x.replace("...", "")), set(y.replace("...", ""))
    return all((c in xs) != (c in ys) for c in k) and all(c in ys for c in xs - set(k))


def choose(layer, variable, frozen: np.ndarray, mode: str, backend: str | None = None):
    """``(slice, eligible)``: what the Freezer's gradients ``mode`` computes for a partially frozen kernel.

    A block :func:`kernel_slice` finds, or for a ``Dense`` kernel the sampled
    product of its elements (:func:`kernel_sample`), whichever costs less:
    the block costs about its fraction of the whole product, the sampled
    product about its fraction over the backend's crossover
    (:data:`AUTO_SAMPLES`: where it costs the whole product). ``eligible`` is
    False for ``"dense"`` and for what ``"auto"`` finds does not pay (the
    block is then still returned: TensorFlow reads an embedding's table by
    rows on every mode).
    """
    if quantized(layer, variable):  # no dense path: what trains is a float delta beside the integers
        return _quantized_choice(layer, variable, frozen)
    ks = kernel_slice(layer, variable, frozen)
    if mode == "dense":
        return ks, False
    block = ks if ks is not None and (mode == "sliced" or pays(ks, backend)) else None
    sample = kernel_sample(layer, variable, frozen)
    if block is not None and block.kind == "rows":  # a table: its rows (the lookup's own gradient) while they are few
        if sample is None or block.fraction <= SAMPLE_AT_MOST:
            return block, True
        return sample, True  # its elements: the batch's size, not the rows' (half the table, as a 1 % mask can be)
    if sample is not None and (mode == "sliced" or pays(sample, backend)):
        crossover = auto_samples(backend) or SAMPLE_AT_MOST  # unmeasured: "sliced"'s
        if block is None or sample.fraction / crossover < block.fraction:
            return sample, True
    return (block, True) if block is not None else (ks, False)


def _quantized_choice(layer, variable, frozen: np.ndarray):
    """A quantized kernel's delta: its block when the trained elements fill it or it is small, else the elements."""
    ks = kernel_slice(layer, variable, frozen, at_most=1.0)
    n = frozen.size - int(np.count_nonzero(frozen))
    sample = kernel_sample(layer, variable, frozen, at_most=1.0)
    if ks is not None and (ks.kind == "rows" or ks.size == n or ks.fraction <= SLICE_AT_MOST or sample is None):
        return ks, True
    return (sample, True) if sample is not None else (ks, ks is not None)


def pays(s: KernelSlice, backend: str | None = None) -> bool:
    """Whether ``gradients="auto"`` gives ``s`` its own weight gradient: where ``benchmarks/`` measured it cheaper.

    An embedding's rows always (``benchmarks/cost.py``: the dense path makes
    the table's gradient); a kernel of :data:`MEMORY_AT` elements or more
    always (its dense gradient is memory that matters: docs/benchmarks.md);
    a smaller kernel's block by :data:`AUTO_PAYS` of the backend
    (``benchmarks/slices.py``); a sampled kernel's elements by :data:`AUTO_SAMPLES`.

    Args:
        s: the block.
        backend: the Keras backend (default: the one in force).
    """
    if s.kind in ("rows", "table elements"):
        return True
    measured = auto_pays(backend)
    if measured is None:  # a backend never measured (numpy takes no gradients): the dense path
        return False
    size = int(np.prod(s.shape, dtype=np.int64))
    if size >= MEMORY_AT:  # memory at stake: the slice's or the elements' own gradient, whatever its time
        return True
    ranges, lists, elements = measured
    big = size >= elements
    if s.kind == "sampled":
        return s.fraction <= auto_samples(backend) and big
    contiguous = all(i is None or len(i) == 0 or int(i[-1]) - int(i[0]) + 1 == len(i) for i in s.index)
    return s.fraction <= (ranges if contiguous else lists) and big


def slice_eligible(owner, variable) -> KernelSlice | None:
    """The slice the Freezer's gradients mode gives ``variable`` its own gradient for, held dense for now or not.

    The layout decides the strategy from this (a sliced kernel is kept
    ``compact``), not from :func:`sliced_gradient`: a kernel on the dense
    gradient for a while (a FreezeBoard recording norms, a plan that changes
    often) keeps the optimizer variables it had.
    """
    mark = mark_of(owner, variable)
    return mark.slice if mark is not None and mark.eligible else None


def standin_of(owner, variable):
    """The stand-in variable (the trained elements of ``variable``) ``owner``'s call hands their gradient to, or None."""
    mark = mark_of(owner, variable)
    return None if mark is None or not mark.eligible else mark.standin


def sliced_gradient(owner, variable) -> KernelSlice | None:
    """The slice whose weight gradient ``owner``'s call computes for ``variable`` now (None: the dense gradient)."""
    mark = mark_of(owner, variable)
    return mark.slice if mark is not None and mark.now() else None


def exact_block(frozen: np.ndarray) -> tuple | None:
    """The trained elements as a block of ranges (a slice per axis), when they are exactly one; else None.

    ``compact`` then gathers and writes them with slices instead of flat
    indices (the same elements in the same order).
    """
    trained = ~np.asarray(frozen, dtype=bool)
    block = []
    for axis in range(trained.ndim):
        along = np.flatnonzero(trained.any(axis=tuple(a for a in range(trained.ndim) if a != axis)))
        if len(along) == 0 or along[-1] - along[0] + 1 != len(along):
            return None
        block.append(slice(int(along[0]), int(along[-1]) + 1))
    block = tuple(block)
    if trained[block].all() and int(trained.sum()) == trained[block].size and trained.size > trained[block].size:
        return block
    return None
