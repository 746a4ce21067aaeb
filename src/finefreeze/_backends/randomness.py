"""The backend's global random generator, where Keras draws from it instead of a seed generator's state.

Keras on PyTorch draws an unseeded ``Dropout``'s masks from PyTorch's global
generator (``torch.nn.functional.dropout``), not from the layer's
``SeedGenerator`` state; TensorFlow and JAX draw every mask from that state.
A resumed run must put PyTorch's generator back where it was, beside the
seed states.
"""

from __future__ import annotations

import numpy as np

from finefreeze._backends.questions import keras_backend

__all__ = ["global_state", "set_global_state"]


def global_state() -> np.ndarray | None:
    """The state of the global generator Keras draws from on this backend (uint8 bytes), or None if it uses none."""
    if keras_backend() != "torch":
        return None
    import torch

    return torch.get_rng_state().numpy().copy()


def set_global_state(state: np.ndarray) -> None:
    """Put back a state :func:`global_state` returned."""
    import torch

    torch.set_rng_state(torch.from_numpy(np.asarray(state, dtype=np.uint8).copy()))
