"""A rule's ``mask=`` held at one bit per element, and its form in plan files."""

from __future__ import annotations

import base64
import math
import zlib

import numpy as np

from finefreeze._errors import PlanError

__all__ = ["PACKED_MASK_AT", "PackedMask", "decode_mask", "encode_mask"]


PACKED_MASK_AT = 64  #: masks with more elements are written packed, 1 bit per element


class PackedMask:
    """A rule's bool mask, held at one bit per element: ``np.asarray(mask)`` gives the bool array.

    A plan lives as long as its ``Freezer``: a mask of random elements over
    every kernel of a 150 M-parameter model held as bools would cost 150 MB
    for the whole run; packed it costs 19 MB. Reading it unpacks a fresh,
    read-only copy (a plan is resolved once per change, not per step).

    Args:
        mask: the bool array.

    Example:
        >>> import numpy as np
        >>> m = PackedMask(np.eye(3, dtype=bool))
        >>> m.shape, int(np.asarray(m).sum())
        ((3, 3), 3)
    """

    __slots__ = ("_bits", "shape")
    dtype = np.dtype(np.bool_)

    def __init__(self, mask: np.ndarray):
        self._hold(np.shape(mask), np.packbits(np.asarray(mask, dtype=np.bool_).reshape(-1)))

    def _hold(self, shape, bits: np.ndarray) -> None:
        self.shape = tuple(int(n) for n in shape)
        self._bits = np.asarray(bits, dtype=np.uint8)
        self._bits.setflags(write=False)

    @classmethod
    def from_bits(cls, bits: np.ndarray, shape) -> PackedMask:
        """The mask of ``np.packbits`` output ``bits`` (C order) for ``shape``, taken as it is (a plan file's)."""
        out = cls.__new__(cls)
        out._hold(shape, bits)
        return out

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self._bits.nbytes)

    @property
    def bits(self) -> np.ndarray:
        """The packed bits (``np.packbits`` of the flattened mask, C order)."""
        return self._bits

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.unpackbits(self._bits, count=self.size).view(np.bool_).reshape(self.shape)
        if dtype is not None and np.dtype(dtype) != np.bool_:
            out = out.astype(dtype)
        out.setflags(write=False)
        return out

    def __getitem__(self, key):
        return np.asarray(self)[key]

    def sum(self, *args, **kwargs):
        """The number of True elements (``np.sum`` of the bools; same arguments)."""
        return np.asarray(self).sum(*args, **kwargs)

    def any(self, *args, **kwargs):
        return np.asarray(self).any(*args, **kwargs)

    def all(self, *args, **kwargs):
        return np.asarray(self).all(*args, **kwargs)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d mask")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"PackedMask(shape={self.shape})"


def encode_mask(mask: PackedMask):
    """A mask as plan files write it: nested bool lists, or ``{"shape", "packbits"}`` when large.

    Large masks (from ``ff.select``, say) would otherwise cost about 6 bytes
    of JSON per element; packed they cost 1/6 byte (base64 of ``np.packbits``).
    A sparse mask is written ``{"shape", "zpackbits"}``, its packed bits
    compressed with zlib first (a 0.1 % selection of a 23 M element model:
    2.7 MB packed, about 0.1 MB compressed).
    """
    if mask.size <= PACKED_MASK_AT:
        return np.asarray(mask).tolist()
    packed = mask.bits.tobytes()
    small = zlib.compress(packed, 9)
    if len(small) < len(packed) // 2:
        return {"shape": list(mask.shape), "zpackbits": base64.b64encode(small).decode("ascii")}
    return {"shape": list(mask.shape), "packbits": base64.b64encode(packed).decode("ascii")}


def decode_mask(value, where: str) -> PackedMask:
    """The mask of :func:`encode_mask`'s packed form, kept packed.

    Raises:
        PlanError: a malformed packed mask.
    """
    keys = set(value)
    if keys not in ({"shape", "packbits"}, {"shape", "zpackbits"}):
        raise PlanError(
            f"{where}: a packed mask has exactly 'shape' and 'packbits' (or 'zpackbits'); got keys {sorted(value)}."
        )
    shape = value["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise PlanError(f"{where}: packed mask shape must be a list of sizes, got {shape!r}.")
    key = "packbits" if "packbits" in keys else "zpackbits"
    try:
        data = base64.b64decode(value[key], validate=True)
        if key == "zpackbits":
            data = zlib.decompress(data)
        raw = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError, zlib.error) as e:
        raise PlanError(
            f"{where}: packed mask bits are not base64{' of zlib data' * (key == 'zpackbits')} ({e})."
        ) from None
    size = math.prod(shape)
    if len(raw) != -(-size // 8):
        raise PlanError(
            f"{where}: packed mask of shape {tuple(shape)} needs {-(-size // 8)} bytes, got {len(raw)}; "
            "write the mask again."
        )
    return PackedMask.from_bits(raw, shape)
