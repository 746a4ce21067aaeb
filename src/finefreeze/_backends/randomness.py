"""The backend's global random generator, where Keras draws from it instead of a seed generator's state.

Keras on PyTorch draws an unseeded ``Dropout``'s masks from PyTorch's global
generator (``torch.nn.functional.dropout``), not from the layer's
``SeedGenerator`` state; TensorFlow and JAX draw every mask from that state.
A resumed run must put PyTorch's generator back where it was, beside the
seed states.
"""

from __future__ import annotations

import numpy as np

from finefreeze._backends.questions import keras_backend, tensorflow_imported
from finefreeze._keras.instances import seed_keras_only

__all__ = ["global_state", "set_global_state", "set_seed"]


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


def set_seed(seed: int) -> None:
    """``keras.utils.set_random_seed(seed)``, without importing TensorFlow off its backend.

    Keras seeds TensorFlow's generator whenever TensorFlow is installed, so
    its ``set_random_seed`` imports it on JAX and PyTorch too (seconds, and
    TensorFlow's notices on stderr). Off TensorFlow, and while nothing has
    imported it, this seeds what Keras seeds but TensorFlow: Keras' global
    seed (its ``SeedGenerator`` made anew from it), Python's, NumPy's and
    PyTorch's generators.
    """
    import random

    import keras

    if keras_backend() == "tensorflow" or tensorflow_imported() is not None:
        keras.utils.set_random_seed(seed)
        return
    seed_keras_only(seed)
    random.seed(seed)
    np.random.seed(seed)
    if keras_backend() == "torch":
        import torch

        torch.manual_seed(seed)
