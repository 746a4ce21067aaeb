"""What the per-backend gradient classes of ``select`` share: accumulators and the loss as a pure function.

Each backend's module (``tensorflow``, ``jax``, ``torch``) subclasses
:class:`Grads`; :mod:`finefreeze._backends.gradients` picks one.
"""

from __future__ import annotations

import gc

import keras
import numpy as np

__all__ = ["Grads", "as_arrays", "one_example", "others_of", "pure_loss", "tensors"]


class Grads:
    """Shared: accumulators, reset, the hand-over as numpy arrays one variable at a time."""

    accs: list

    def add(self, kind: str, x, y) -> None:
        self._steps[kind](*self._inputs(x, y))

    def _inputs(self, x, y):
        return x, y

    def reset(self) -> None:
        self.accs[:] = [self._zeros(a) for a in self.accs]

    def take(self, *, keep: bool) -> list[np.ndarray]:
        """The accumulators as float32 numpy arrays; without ``keep`` they are released one at a time."""
        if keep:
            return [self._numpy(a, copy=True) for a in self.accs]
        self._steps.clear()  # compiled steps may hold the accumulators
        gc.collect()
        out = []
        for j in range(len(self.accs)):  # never two full copies
            out.append(self._numpy(self.accs[j], copy=False))
            self.accs[j] = None
        return out


def others_of(model, variables):
    ids = {id(v) for v in variables}
    return [v for v in model.variables if id(v) not in ids]


def pure_loss(model, variables, others, loss_fn):
    """``f(values, other_values, x, y, training) -> (loss, new other_values)`` with no side effect on the model."""

    def f(values, other_values, x, y, training):
        mapping = list(zip(variables, values)) + list(zip(others, other_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            loss = loss_fn(y, model(x, training=training))
        new = [scope.get_current_value(v) for v in others]
        return loss, [o if n is None else n for o, n in zip(other_values, new)]

    return f


def one_example(tree):
    """An example as a batch of one."""
    return keras.tree.map_structure(lambda t: t[None], tree)


def as_arrays(tree):
    """Leaves that are not tensors of the backend in force (tf.data batches) as numpy arrays."""
    return keras.tree.map_structure(lambda t: t if keras.ops.is_tensor(t) else np.asarray(t), tree)


def tensors(tree):
    return keras.tree.map_structure(keras.ops.convert_to_tensor, as_arrays(tree))
