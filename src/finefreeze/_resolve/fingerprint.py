"""Fingerprints of frozen elements, and the check that they did not move.

Each variable's raw bytes (trainable elements zeroed) are cut into blocks of
``BLOCK`` elements; each block keeps one 64-bit linear hash with odd
multipliers, so any change of a single element (one flipped bit included)
changes its block's hash. Cost: 8 bytes per block, 1/128 of a float32
variable; a change is localised to one block of ``BLOCK`` elements.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.distribute import replica_values
from finefreeze._backends.read import read
from finefreeze._errors import FrozenValueChanged, PlanError
from finefreeze._keras.quantized import quantized_values
from finefreeze._resolve.targets import match_path, var_path

__all__ = ["Fingerprint", "fingerprinted_items", "take", "BLOCK"]

BLOCK = 256
_CHUNK_BLOCKS = 4096
_MULT = np.random.default_rng(20261129).integers(0, 2**63, size=BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _words(value: np.ndarray) -> np.ndarray:
    value = np.ascontiguousarray(value).reshape(-1)
    width = value.dtype.itemsize
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width)
    if uint is None:  # pragma: no cover - exotic dtypes
        return np.frombuffer(value.tobytes(), dtype=np.uint8)
    return value.view(uint)


def block_hashes(value: np.ndarray, frozen: np.ndarray | None) -> np.ndarray:
    """One uint64 per block of ``BLOCK`` elements of ``value``'s frozen part."""
    words = _words(value)
    frozen = None if frozen is None else frozen.reshape(-1)
    n = words.size
    if 0 < n <= BLOCK:  # one block: the padded sum without the padding
        if frozen is not None:
            words = np.where(frozen, words, 0)
        with np.errstate(over="ignore"):
            return np.array([(words.astype(np.uint64) * _MULT[:n]).sum(dtype=np.uint64)], dtype=np.uint64)
    n_blocks = (n + BLOCK - 1) // BLOCK
    out = np.empty(n_blocks, dtype=np.uint64)
    step = _CHUNK_BLOCKS * BLOCK
    with np.errstate(over="ignore"):
        for b0 in range(0, n_blocks, _CHUNK_BLOCKS):
            chunk = words[b0 * BLOCK : b0 * BLOCK + step].astype(np.uint64)
            if frozen is not None:  # trainable elements count as 0, chunk by chunk: no copy of the variable
                chunk[~frozen[b0 * BLOCK : b0 * BLOCK + step]] = 0
            pad = (-chunk.size) % BLOCK
            if pad:
                chunk = np.concatenate([chunk, np.zeros(pad, dtype=np.uint64)])
            chunk = chunk.reshape(-1, BLOCK)
            out[b0 : b0 + chunk.shape[0]] = (chunk * _MULT).sum(axis=1, dtype=np.uint64)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    path: str
    variable: object
    shape: tuple
    frozen: object  # ElementMask or None (whole variable)
    hashes: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Fingerprint:
    """Block hashes of the frozen elements of a set of variables."""

    entries: tuple[_Entry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.hashes.nbytes for e in self.entries)

    def check(self, read=None) -> list[tuple[str, str]]:
        """Return ``(path, where)`` for each variable whose frozen part changed.

        Args:
            read: ``variable -> list of numpy values`` (one per replica);
                defaults to every replica's copy of a distributed variable.
        """
        if read is None:
            read = replica_values
        bad = []
        for e in self.entries:
            frozen = None if e.frozen is None else e.frozen.dense()
            for r, value in enumerate(read(e.variable)):
                got = block_hashes(value, frozen)
                diff = np.flatnonzero(got != e.hashes)
                if diff.size:
                    rep = f" on replica {r}" if r else ""
                    bad.append((e.path, _describe(diff, e.shape, e.hashes.size) + rep))
                    break
        return bad

    def compare(self, reference) -> list[tuple[str, str]]:
        """Return ``(path, where)`` for each variable whose frozen elements differ
        from the same variable of ``reference`` (a collected target), to the element.

        Raises:
            PlanError: ``reference`` lacks a variable or has another shape.
        """
        by_path = {n: vi for vi in reference.variables for n in vi.names}
        bad = []
        for e in self.entries:
            ref = match_path(e.path, by_path)
            if ref is None:
                raise PlanError(f"the reference has no variable {e.path!r} (shape {e.shape}); compare the same model.")
            stored = tuple(int(d) for d in ref.variable.shape)  # an int4 kernel's: packed, as e.shape is
            if stored != tuple(int(d) for d in e.variable.shape):
                raise PlanError(f"variable {e.path!r} has shape {e.shape} here but {stored} in the reference.")
            now, then = _words(to_numpy(e.variable)), _words(to_numpy(ref.variable))
            diff = now != then
            if e.frozen is not None:
                diff &= e.frozen.dense().reshape(-1)
            idx = np.flatnonzero(diff)
            if idx.size:
                first = ", ".join(str(tuple(int(i) for i in np.unravel_index(j, e.shape))) for j in idx[:5])
                more = ", ..." if idx.size > 5 else ""
                bad.append((e.path, f"{idx.size} frozen element(s) differ at {first}{more} (shape {tuple(e.shape)})"))
        return bad

    def verify(self, read=None, reference=None) -> None:
        """Raise :class:`FrozenValueChanged` if any frozen element moved."""
        bad = self.check(read) if reference is None else self.compare(reference)
        if bad:
            lines = "\n".join(f"  {p}: {w}" for p, w in bad)
            since = "since they were frozen" if reference is None else "from the reference"
            raise FrozenValueChanged(
                f"{len(bad)} variable(s) have frozen elements that changed {since}:\n{lines}\n"
                "Something outside the FreezingOptimizer wrote to them (another optimizer, an "
                "assign, a weight load), or the 'mask' strategy was used with a stateful optimizer.",
                bad,
            )


def _describe(diff, shape, n_blocks) -> str:
    size = int(np.prod(shape, dtype=np.int64))
    parts = []
    for b in diff[:3]:
        lo, hi = int(b) * BLOCK, min(size, (int(b) + 1) * BLOCK) - 1
        if shape:
            parts.append(
                f"{tuple(int(x) for x in np.unravel_index(lo, shape))}..{tuple(int(x) for x in np.unravel_index(hi, shape))}"
            )
        else:
            parts.append("()")
    more = f" and {diff.size - 3} more blocks" if diff.size > 3 else ""
    return (
        f"changed in {diff.size} of {n_blocks} blocks of {BLOCK} elements; first "
        f"changed elements within {', '.join(parts)}{more} (shape {tuple(shape)})"
    )


def fingerprinted_items(states) -> list[tuple]:
    """The :func:`take` items of ``states``: a quantized kernel's stored integers, scales and zero points whole.

    What trains of a quantized kernel is a float delta beside it: every byte
    Keras stores for it stays as it was.
    """
    items = []
    for s in states:
        if s.info.quantized is None:
            items.append((s.path, s.variable, s.info.shape, s.mask))
            continue
        for v in quantized_values(s.info.owner, s.variable):
            path = s.path if v is s.variable else var_path(v)
            items.append((path, v, tuple(int(d) for d in v.shape), None))
    return items


def take(items) -> Fingerprint:
    """Fingerprint ``(path, variable, shape, frozen ElementMask or None)`` items."""
    entries, small = [], []
    for path, var, shape, mask in items:
        value = read(var)
        frozen = None if mask is None else mask.dense()
        if frozen is None and 0 < value.size <= BLOCK:  # hashed together below
            small.append((len(entries), _words(value)))
            entries.append((path, var, tuple(shape), mask))
            continue
        entries.append((path, var, tuple(shape), mask, block_hashes(value, frozen)))
    if small:
        hashes = _one_block_hashes([w for _, w in small])
        for (k, _), h in zip(small, hashes):
            entries[k] = (*entries[k], np.array([h], dtype=np.uint64))
    return Fingerprint(tuple(_Entry(*e) for e in entries))


def _one_block_hashes(words: list[np.ndarray]) -> np.ndarray:
    """``block_hashes`` of many one-block arrays in one vectorised pass (same values)."""
    sizes = np.fromiter((w.size for w in words), dtype=np.int64, count=len(words))
    flat = np.concatenate([w.astype(np.uint64) for w in words])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pos = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, sizes)
    with np.errstate(over="ignore"):
        return np.add.reduceat(flat * _MULT[pos], starts, dtype=np.uint64)
