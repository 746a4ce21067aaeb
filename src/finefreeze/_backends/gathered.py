"""The sampled product by gathers, shared by every backend: chunks of pairs, each gathering its columns as rows.

``sum_n x[n, a] * dy[n, b]`` for pairs ``(a, b)`` given by their flat
indices: :func:`gathered_dots` (``functional.sampled_dots``, and the
backends' products that gather), sized by :func:`chunk_plan`, cutting
windows of a sorted side where :func:`window_width` says they pay; and the
product with a matrix that is zero but at such pairs, :func:`spread`
(``functional.scattered_product``).
"""

from __future__ import annotations

import functools

import keras
from keras import ops

__all__ = [
    "chunk_plan",
    "cut_columns",
    "gathered_dots",
    "in_chunks",
    "pair_sums",
    "spread",
    "sum_dtype",
    "window_width",
]


def chunk_plan(count: int, tokens, chunk: int) -> tuple[int, int]:
    """``(per, chunks)``: pairs per chunk and the number of chunks of a sampled product of ``count`` pairs.

    A chunk gathers at most ``chunk`` values of ``x`` (``tokens`` rows of
    them; None, a graph traced for any batch: chunks for 512). Where a power
    of two at least a quarter of that long divides ``count``, the chunks are
    that long and nothing is padded in the step: XLA on a CPU keeps
    megabytes of compiled code per padded product. (The sampled product's
    index is padded to a multiple of 1,024 pairs: one does for batches of
    512 tokens or more.)
    """
    per = max(1, min(count, chunk // (int(tokens) if tokens is not None else 512)))
    even = min(count & -count, 1 << (per.bit_length() - 1))  # the largest power of two <= per dividing count
    if count % per and 4 * even >= per:
        per = even
    return per, -(-count // per)


def gathered_dots(
    x, dy, flat, columns, chunk: int, transpose, map_chunks, gather=None, order=None, window=None, cut=None
):
    """``functional.sampled_dots`` by gathers: the columns as rows of the transposed arrays, ``chunk`` values at a time.

    The chunks run one after another (``map_chunks``, a backend's
    ``map_in_turn``, over chunks of ``flat``), so no temporary grows
    with the kernel; each chunk's columns are computed in its turn, from its
    part of ``flat`` (``columns``: no array of every pair's ``a`` and ``b``
    lives through the loop, and XLA compiles the arithmetic into the
    gathers). ``transpose`` is the backend's ``transposed``;
    :func:`chunk_plan` sizes the chunks. ``gather(t, rows)``: the backend's
    gather of whole rows, at indices never negative (default
    ``keras.ops.take``, which also handles negative ones: in a TensorFlow
    graph, operations per kernel that the step keeps).

    Where ``window`` gives a chunk's span ``w`` of the sorted side, each
    chunk transposes only the ``w`` columns from its first pair's on
    (``cut(t, lo, w)``, default :func:`cut_columns`), never that side
    whole: a tied table's logits' gradient, whose pairs are sorted by the
    vocabulary's row. The sums are the same bits.
    """
    gather = gather or functools.partial(ops.take, axis=0)
    cut = cut or cut_columns
    count = int(flat.shape[0])
    per, chunks = chunk_plan(count, x.shape[0], chunk)
    w = window_width(window, order, per, x, dy, chunk)
    xt = None if w is not None and order == "a" else transpose(x)  # each element's column a contiguous row
    dyt = None if w is not None and order == "b" else transpose(dy)

    def rows_of(t, whole, at):
        if whole is not None:
            return gather(whole, at)
        lo = ops.minimum(at[0], ops.cast(int(t.shape[1]) - w, at.dtype))  # the window ends inside ``t``
        return gather(transpose(cut(t, lo, w)), at - lo)

    def dots(part):
        a, b = columns(part)
        return pair_sums(rows_of(x, xt, a), rows_of(dy, dyt, b))

    if chunks == 1:
        return dots(flat)
    sums = ops.reshape(map_chunks(dots, in_chunks(flat, chunks, per), sum_dtype(x.dtype)), (-1,))
    return sums if chunks * per == count else sums[:count]


def sum_dtype(dtype) -> str:
    """The dtype the sampled product sums ``dtype`` in: half precision in float32, as a matmul sums it."""
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def pair_sums(xa, yb):
    """Each row's ``sum(xa * yb)``, in :func:`sum_dtype`."""
    wide = sum_dtype(xa.dtype)
    if keras.backend.standardize_dtype(xa.dtype) != wide:
        xa, yb = ops.cast(xa, wide), ops.cast(yb, wide)
    return ops.sum(xa * yb, axis=1)


def in_chunks(flat, chunks: int, per: int):
    """``flat`` as ``(chunks, per)``, its last pair repeated to fill the last chunk: the pairs stay sorted."""
    if chunks * per > int(flat.shape[0]):  # (ops.pad would make a named Keras operation at every step)
        flat = ops.concatenate([flat, ops.repeat(flat[-1:], chunks * per - int(flat.shape[0]))])
    return ops.reshape(flat, (chunks, per))


def window_width(window, order: str | None, per: int, x, dy, chunk: int) -> int | None:
    """The columns a chunk of ``per`` pairs cuts of its sorted side, or None: that side transposed whole, once.

    ``window(per)`` (see ``functional.sampled_dots``), where the side's transpose
    would hold more than two chunks' values (a tied table's logits'
    gradient; a layer's input at the usual batches holds about one: its
    transpose, made in the layer's turn of the backward pass, costs less
    than the windows' code) and the window is under half of the side's
    columns (a wider one saves too little).
    """
    if window is None or order not in ("a", "b"):
        return None
    side = x if order == "a" else dy
    tokens = int(side.shape[0]) if side.shape[0] is not None else 512
    if tokens * int(side.shape[1]) <= 2 * chunk:
        return None
    w = window(per)
    return w if w is not None and 2 * w <= int(side.shape[1]) else None


def cut_columns(t, lo, w: int):
    """The columns ``lo`` to ``lo + w`` of a 2-D ``t`` (``lo`` a scalar tensor, ``w`` a constant)."""
    return ops.slice(t, (ops.zeros_like(lo), lo), (int(t.shape[0]), w))


def spread(t, values, take_at, add_at, width: int, chunk: int, transpose, add_rows):
    """``out[n, add_at[e]] += t[n, take_at[e]] * values[e]`` for every pair ``e``, by gathers: ``(N, width)``.

    ``functional.scattered_product``: ``t``'s column of each pair gathered
    as a row of its transpose (``transpose``, the backend's ``transposed``),
    times the pair's value, added into its row of the result's transpose
    (``add_rows``, the backend's), at most ``chunk`` gathered values at a
    time, one chunk after another (a loop), into one sum.
    """
    tt = transpose(t)  # (A, N): a pair's column of t is a whole row here
    n, batch = int(values.shape[0]), tt.shape[1]
    per = max(1, chunk // batch) if batch else 4096
    values = ops.cast(values, t.dtype)

    def part(take, add, v):
        return add_rows(ops.take(tt, take, axis=0) * ops.expand_dims(v, 1), add, width)

    if n <= per:
        return ops.transpose(part(take_at, add_at, values))
    chunks = -(-n // per)
    pad = chunks * per - n  # zeros: they add nothing

    def laid(a):
        return ops.reshape(ops.concatenate([a, ops.zeros((pad,), dtype=a.dtype)]), (chunks, per))

    takes, adds, vs = laid(take_at), laid(add_at), laid(values)
    total = ops.zeros((width, batch if batch else ops.shape(tt)[1]), dtype=t.dtype)
    total = ops.fori_loop(0, chunks, lambda i, acc: acc + part(takes[i], adds[i], vs[i]), total)
    return ops.transpose(total)
