"""Compact storage of per-element frozen masks.

A mask is kept in whichever form is smallest: a sorted list of flat indices
(of the frozen or of the trainable elements, whichever is rarer) or packed
bits (one bit per element). A dense bool array is only built on request.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ElementMask"]


class ElementMask:
    """Immutable frozen-element mask of one variable (True = frozen).

    Example:
        >>> m = ElementMask.from_dense(np.array([[True, False], [False, True]]))
        >>> m.n_frozen, m.n_trainable
        (2, 2)
    """

    __slots__ = ("shape", "size", "_kind", "_data", "n_frozen")

    def __init__(self, shape, kind, data, n_frozen):
        self.shape = tuple(int(d) for d in shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self._kind = kind  # "bits" | "frozen_idx" | "train_idx"
        self._data = data
        self.n_frozen = int(n_frozen)

    @classmethod
    def from_dense(cls, frozen: np.ndarray) -> ElementMask:
        """Store a dense bool array in its most compact form."""
        frozen = np.asarray(frozen, dtype=bool)
        flat = frozen.reshape(-1)
        size = flat.size
        n_frozen = int(np.count_nonzero(flat))
        rare = min(n_frozen, size - n_frozen)
        idx_dtype = np.int32 if size < 2**31 else np.int64
        if rare * np.dtype(idx_dtype).itemsize < (size + 7) // 8:
            if n_frozen <= size - n_frozen:
                data = np.flatnonzero(flat).astype(idx_dtype)
                kind = "frozen_idx"
            else:
                data = np.flatnonzero(~flat).astype(idx_dtype)
                kind = "train_idx"
        else:
            data, kind = np.packbits(flat), "bits"
        data.setflags(write=False)
        return cls(frozen.shape, kind, data, n_frozen)

    @property
    def n_trainable(self) -> int:
        return self.size - self.n_frozen

    @property
    def nbytes(self) -> int:
        """Bytes held by this mask."""
        return int(self._data.nbytes)

    def dense(self) -> np.ndarray:
        """Dense bool array of the variable's shape (True = frozen)."""
        if self._kind == "bits":
            flat = np.unpackbits(self._data, count=self.size).astype(bool)
        elif self._kind == "frozen_idx":
            flat = np.zeros(self.size, dtype=bool)
            flat[self._data] = True
        else:
            flat = np.ones(self.size, dtype=bool)
            flat[self._data] = False
        return flat.reshape(self.shape)

    def trainable_flat_indices(self) -> np.ndarray:
        """Sorted flat indices of the trainable elements."""
        if self._kind == "train_idx":
            return self._data.astype(np.int64)
        return np.flatnonzero(~self.dense().reshape(-1))

    def frozen_flat_indices(self) -> np.ndarray:
        """Sorted flat indices of the frozen elements."""
        if self._kind == "frozen_idx":
            return self._data.astype(np.int64)
        return np.flatnonzero(self.dense().reshape(-1))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, ElementMask)
            and self.shape == other.shape
            and self.n_frozen == other.n_frozen
            and np.array_equal(self.dense(), other.dense())
        )

    def __hash__(self):
        return hash((self.shape, self.n_frozen))

    def __repr__(self) -> str:
        return f"ElementMask(shape={self.shape}, frozen={self.n_frozen}/{self.size}, {self._kind})"
