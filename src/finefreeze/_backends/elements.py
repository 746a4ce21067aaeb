"""Read and write some elements of a variable in place, outside any train step (deltas in and out).

- TensorFlow: ``scatter_nd_update`` on the variable's resource (through
  ``write_all``, so a distributed variable's every copy is written); reads
  gather from a dense read (``ResourceGatherNd``).
- JAX: a jitted scatter that donates the variable's buffer, so XLA writes
  the elements into it (no second copy of the variable; the same donation
  Keras' own train step makes); its inputs padded to a few lengths, so
  that kernels of one shape share a compiled program.
- PyTorch: ``index_put_`` into the flattened value under ``no_grad`` (int64
  indices, taken as they are; reads index the value the same way).

A whole variable (``index`` None) is assigned. Reads gather the elements
into a new numpy array (:func:`~finefreeze._backends.read.read` views the
buffer: no copy of the variable).
"""

from __future__ import annotations

import numpy as np

from finefreeze._backends.chosen import chosen

__all__ = ["read_elements", "write_elements"]


def read_elements(variable, index: np.ndarray | None) -> np.ndarray:
    """A copy of ``variable``'s elements at the flat indices ``index`` (None: the whole value)."""
    return chosen().read_elements(variable, index)


def write_elements(variable, index: np.ndarray | None, values: np.ndarray) -> None:
    """Write ``values`` at the flat indices ``index`` of ``variable`` in place (None: assign the whole value)."""
    if index is None:
        variable.assign(values)
        return
    chosen().write_elements(variable, index, values)
