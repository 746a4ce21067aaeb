"""Per-example gradients of ``select`` on PyTorch: ``torch.func.vmap(torch.func.grad(...))``, else a loop."""

from __future__ import annotations

import warnings

import keras
import torch
from torch.func import grad, vmap

from finefreeze._backends.accumulate import Grads, one_example, others_of, pure_loss, tensors
from finefreeze._errors import PlanError

__all__ = ["Gradients"]


def _differentiable(fn):
    """``fn`` (a ``torch.func`` gradient), with PyTorch's refusal of an old-style ``autograd.Function`` as a PlanError.

    ``torch.func`` differentiates only an ``autograd.Function`` that defines
    ``setup_context``; Keras' float8 layers compute with one that does not.
    """

    def run(*args):
        try:
            return fn(*args)
        except RuntimeError as e:
            if "setup_context" not in str(e):
                raise
            raise PlanError(
                "select: PyTorch's torch.func cannot differentiate this model: one of its layers computes with a "
                "torch.autograd.Function that has no setup_context (Keras' float8 layers, after "
                "quantize('float8'), do). Select on the model before quantize() (the plan it returns applies "
                "after it), or on TensorFlow or JAX."
            ) from None

    return run


class Gradients(Grads):
    def __init__(self, model, variables, loss_fn, mode):
        others = others_of(model, variables)
        f = pure_loss(model, variables, others, loss_fn)
        self.variables, self.others, self.mode = variables, others, mode
        self.accs = [torch.zeros(tuple(v.shape), dtype=torch.float32, device=v.value.device) for v in variables]
        batch_grads = _differentiable(grad(lambda values, ovals, x, y: f(values, ovals, x, y, False)[0]))

        def example_grads(values, ovals, xi, yi):
            return batch_grads(values, ovals, one_example(xi), one_example(yi))

        vectorized = vmap(example_grads, in_dims=(None, None, 0, 0))

        def gradient_step(x, y):
            g = batch_grads(*self._values(), x, y)
            with torch.no_grad():
                for a, gi in zip(self.accs, g):
                    a.add_(gi.to(torch.float32).abs())

        def fisher_step(x, y):
            values, ovals = self._values()
            if self.mode != "loop":
                try:
                    with warnings.catch_warnings():
                        # "There is a performance drop because we have not yet implemented the batching
                        # rule for ...": PyTorch falls back to a loop inside vmap; the result is the same.
                        warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
                        squares = [gi.to(torch.float32).square().sum(0) for gi in vectorized(values, ovals, x, y)]
                except RuntimeError as e:
                    if self.mode == "vectorized":
                        said = next((ln.strip() for ln in str(e).splitlines() if "vmap" in ln), str(e))[:200]
                        raise PlanError(
                            f"select: per_example='vectorized': torch.func.vmap cannot batch this model's gradient "
                            f"({said}); use per_example='auto' or 'loop' (one example at a time)."
                        ) from None
                    self.mode = "loop"  # an op vmap cannot batch: one example at a time from now on
                else:
                    with torch.no_grad():
                        for a, sq in zip(self.accs, squares):
                            a.add_(sq)
                    return
            n = len(keras.tree.flatten(y)[0])
            for i in range(n):
                pick = lambda t, i=i: t[i]  # noqa: E731
                g = example_grads(values, ovals, keras.tree.map_structure(pick, x), keras.tree.map_structure(pick, y))
                with torch.no_grad():
                    for a, gi in zip(self.accs, g):
                        a.add_(gi.to(torch.float32).square())

        self._steps = {"gradient": gradient_step, "fisher": fisher_step}

    def _values(self):
        return [v.value.detach() for v in self.variables], [v.value.detach() for v in self.others]

    def _inputs(self, x, y):
        return tensors(x), tensors(y)

    @staticmethod
    def _zeros(a):
        return a.zero_()

    @staticmethod
    def _numpy(a, copy):
        out = a.detach().cpu().numpy()
        return out.copy() if copy else out

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        others = others_of(model, variables)
        f = pure_loss(model, variables, others, loss_fn)
        grads = _differentiable(grad(lambda values, ovals, x, y: f(values, ovals, x, y, True), has_aux=True))

        def step(x, y):
            values = [v.value.detach() for v in variables]
            g, new = grads(values, [v.value.detach() for v in others], tensors(x), tensors(y))
            with torch.no_grad():
                for v, n in zip(others, new):  # state the call changed (seeds, BatchNormalization statistics)
                    v.assign(n)
                optimizer.apply(g, variables)

        return step
