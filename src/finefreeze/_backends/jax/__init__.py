"""The backend interface on JAX (see ``functional``): immutable values, donated buffers, ``jax.custom_vjp``."""

from __future__ import annotations

import functools
import os

import numpy as np

from finefreeze._backends import functional, gathered
from finefreeze._backends.functional import *  # noqa: F403  (the defaults this module does not override)

__all__ = ["IN_PLACE_FLAG", *functional.__all__]  # the whole interface: ``functional``'s, some of it overridden here

SPARSE_LOOKUPS = False
INT64_INDICES_ONLY = False
PAIRS_BY_POSITION = True  # Keras' JAX trainer: stateless_apply over the built-on list


def has_int64() -> bool:
    """Whether JAX computes with 64-bit integers (``jax_enable_x64``)."""
    import jax

    return bool(jax.config.jax_enable_x64)


#: XLA on a CPU copies a donated variable that a step both reads and updates in part (a block or some
#: elements written back into a kernel), unless its copy insertion uses region analysis (benchmarks/llm_memory.py)
IN_PLACE_FLAG = "--xla_cpu_copy_insertion_use_region_analysis"


def prefer_in_place_updates() -> bool:
    """Let XLA write a variable's updated part in place (set before JAX starts; True if set now).

    A partially frozen kernel's trained part is written back into the kernel
    inside the step. XLA on a CPU keeps the kernel's old value for the
    step's other reads with a copy of the whole kernel, unless its copy
    insertion uses region analysis (XLA on a GPU does by default): this
    adds ``--xla_cpu_copy_insertion_use_region_analysis=true`` to
    ``XLA_FLAGS`` when JAX has not started yet and the user set nothing
    for it (``=false`` in ``XLA_FLAGS`` keeps XLA's default).
    """
    if IN_PLACE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return False
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {IN_PLACE_FLAG}=true".strip()
    return True


def from_host(array: np.ndarray):
    """``array`` copied to the device as it is (``jax.device_put``): nothing is compiled.

    ``jnp.asarray`` of a host array, and ``jnp.zeros``, compile a program
    for each shape they make (an identity, a broadcast), and JAX keeps each:
    about 1.4 MB of the process's memory apiece on a CPU. The variables of a
    plan whose partially trained kernels each train a number of elements of
    its own (a vector of trained values, its index, the optimizer's state of
    it) took two such programs per kernel: 160 MB for the 56 kernels of a
    152 M-parameter LLM (``benchmarks/llm_memory.py``).
    """
    import jax

    return jax.device_put(array)


def snapshot(v):
    """The variable's value itself: JAX arrays are immutable (a copy would cost a pass inside the jitted step)."""
    return v.value


@functools.cache
def _scatter():
    import jax

    def scatter(value, index, values):
        return value.reshape(-1).at[index].set(values).reshape(value.shape)

    return jax.jit(scatter, donate_argnums=0)


def _padded(index: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``index`` and ``values`` padded (the last element written again) to one of 8 lengths per power of two.

    XLA compiles the scatter once per shape: kernels of one shape whose
    trained counts differ a little (a random 1 % of each) share one program
    instead of one each (JAX's compiled programs are memory the process keeps).
    Padding adds at most 1/8 to the writes; an element written twice gets the same value.
    """
    n = int(index.size)
    if n < 16:
        return index, values
    step = 1 << (n.bit_length() - 4)
    m = -(-n // step) * step
    if m == n:
        return index, values
    return np.concatenate([index, np.repeat(index[-1:], m - n)]), np.concatenate(
        [values, np.repeat(values[-1:], m - n)]
    )


def write_elements(variable, index: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` at ``index`` with a jitted scatter that donates the variable's buffer (written in place)."""
    variable.assign(_scatter()(variable.value, *_padded(np.asarray(index), np.asarray(values))))


def sampled_dots(x, dy, flat, columns, order: str | None, chunk: int, window=None):
    """``functional.sampled_dots``, its transpose of ``x`` made once ``dy`` exists, in less compiled code.

    ``x`` (a layer's input, kept from the forward pass) gets one column of
    ``dy`` appended, so that its transpose waits for ``dy``: otherwise XLA
    makes every layer's transposed input during the forward pass and holds
    it to that layer's backward, at the step's peak memory (an optimization
    barrier does not hold it back on a CPU). Chunk columns are computed from
    the flat indices as unsigned integers and the gathers promise in-bounds
    indices (they are): less compiled code, which XLA holds for as long as
    the step lives. The sums are the same bits.

    ``window`` (see ``gathered.gathered_dots``): each chunk reads only the
    columns its pairs span of the sorted side, transposed by itself, so no
    transpose of that side's whole array exists (a tied table's reverse
    projection: the logits' gradient). Each turn of a ``lax.scan``
    transposes the next chunk's window into the loop's state while it
    gathers from the one made in the turn before: a buffer of its own, read
    by rows (cut in the chunk's own turn, XLA fuses the transpose into the
    gathers, which then read it strided). docs/benchmarks.md has the times.
    """
    import jax
    import jax.numpy as jnp

    per, chunks = gathered.chunk_plan(int(flat.shape[0]), x.shape[0], chunk)
    w = gathered.window_width(window, order, per, x, dy, chunk) if chunks > 1 else None
    x = jnp.concatenate([x, _column_after(dy, x)], axis=1)
    unsigned = jnp.uint64 if flat.dtype == jnp.int64 else jnp.uint32

    def unsigned_columns(part):
        return columns(part.astype(unsigned))

    def gather(t, rows):
        return t.at[rows].get(mode="promise_in_bounds")

    if w is None:
        return gathered.gathered_dots(
            x, dy, flat, unsigned_columns, chunk, functional.transposed, functional.map_in_turn, gather
        )
    count, side = int(flat.shape[0]), 0 if order == "a" else 1
    cut, whole = (x, dy) if side == 0 else (dy, x)
    width = int(cut.shape[1]) - (1 if side == 0 else 0)  # x's appended column is never a pair's
    whole_t = functional.transposed(whole)
    parts = gathered.in_chunks(flat, chunks, per).astype(unsigned)
    los = jnp.minimum(columns(parts[:, 0])[side], width - w).astype(unsigned)  # each window ends inside

    def window_of(lo):
        return jax.lax.dynamic_slice(cut, (jnp.zeros_like(lo), lo), (cut.shape[0], w)).T

    def turn(t, chunk_and_los):
        part, lo, lo_next = chunk_and_los
        pair = columns(part)
        rows, others = gather(t, pair[side] - lo), gather(whole_t, pair[1 - side])
        return window_of(lo_next), gathered.pair_sums(*((rows, others) if side == 0 else (others, rows)))

    following = jnp.concatenate([los[1:], los[-1:]])
    _, sums = jax.lax.scan(turn, window_of(los[0]), (parts, los, following))
    sums = sums.reshape(-1)
    return sums if chunks * per == count else sums[:count]


def _column_after(dy, x):
    """A column for ``x`` that exists only once ``dy`` does (its values are never read).

    One column of ``dy`` itself, or, under a ``keras.distribution`` (whose
    layouts may shard ``dy``'s columns, as KerasHub's do a feed-forward
    layer's), ``dy``'s sum broadcast: a column cut from a sharded axis makes
    XLA replicate the whole of ``dy`` on every device ("involuntary full
    rematerialization"), a sum all-reduces one number.
    """
    import jax.numpy as jnp
    import keras

    if keras.distribution.distribution() is None:
        return dy[:, :1].astype(x.dtype)
    return jnp.broadcast_to(jnp.sum(dy).astype(x.dtype), (x.shape[0], 1))


def tap(y, x, k, s, weight_gradient):
    """``y`` through a ``jax.custom_vjp`` whose backward hands ``dy`` on and gives ``s`` its gradient."""
    import jax

    dtype = s.dtype

    @jax.custom_vjp
    def tap(y, x, k, s):
        return y

    def fwd(y, x, k, s):
        return y, (x, k)

    def bwd(res, dy):
        x, k = res
        return dy, None, None, weight_gradient(x, dy, k).astype(dtype)

    tap.defvjp(fwd, bwd)
    return tap(y, x, k, s)


def vjp(op, x, k, dy):
    """The gradient of ``sum(op(x, k) * dy)`` with respect to ``k``: ``jax.vjp``."""
    import jax

    return jax.vjp(lambda kk: op(x, kk), k)[1](dy)[0]
