"""A 2-D view of a frozen mask, for pictures (TensorBoard images, plots)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["as_matrix", "frozen_fraction_image", "to_rgb", "FROZEN_RGB", "TRAINED_RGB"]

FROZEN_RGB = (70, 100, 170)  #: frozen elements (blue)
TRAINED_RGB = (245, 150, 40)  #: trained elements (orange)


def as_matrix(mask: np.ndarray) -> np.ndarray:
    """Matrices as they are; ``(..., n)`` as ``(prod(...), n)``; vectors folded near-square."""
    mask = np.asarray(mask)
    if mask.ndim == 2:
        return mask
    if mask.ndim > 2:
        return mask.reshape(-1, mask.shape[-1])
    flat = mask.reshape(-1)
    width = max(1, math.ceil(math.sqrt(flat.size)))
    rows = math.ceil(flat.size / width)
    out = np.zeros(rows * width, dtype=np.float64)  # padding shows as trained, never as frozen
    out[: flat.size] = flat
    return out.reshape(rows, width)


def frozen_fraction_image(mask: np.ndarray, max_side: int = 256) -> np.ndarray:
    """Float image in ``[0, 1]``: the frozen fraction of each pixel's block of elements."""
    m = as_matrix(mask).astype(np.float64)
    fy = max(1, math.ceil(m.shape[0] / max_side))
    fx = max(1, math.ceil(m.shape[1] / max_side))
    if fy == 1 and fx == 1:
        return m
    h, w = math.ceil(m.shape[0] / fy), math.ceil(m.shape[1] / fx)
    pad = np.full((h * fy, w * fx), np.nan)
    pad[: m.shape[0], : m.shape[1]] = m
    return np.nanmean(pad.reshape(h, fy, w, fx), axis=(1, 3))


def to_rgb(frac: np.ndarray) -> np.ndarray:
    """uint8 ``(h, w, 3)``: trained orange, frozen blue, blocks mixed by fraction."""
    f = np.asarray(frac, dtype=np.float64)[..., None]
    rgb = f * np.array(FROZEN_RGB) + (1.0 - f) * np.array(TRAINED_RGB)
    return np.round(rgb).astype(np.uint8)
