"""The ``torch.autograd.Function`` through which a stand-in gives its trained slice its gradient.

A module of its own, imported where first used: a class statement inside a
function traced by ``torch.compile`` splits the compiled step (Dynamo does
not trace ``__build_class__``), while an import it runs as Python does.
"""

from __future__ import annotations

import torch


class Tap(torch.autograd.Function):
    """``y`` unchanged forward; backward hands ``dy`` on and gives ``s`` the weight gradient of ``(x, dy, k)``."""

    @staticmethod
    def forward(ctx, y, x, k, s, weight_gradient):
        ctx.save_for_backward(x, k)
        ctx.weight_gradient, ctx.dtype = weight_gradient, s.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        x, k = ctx.saved_tensors
        return dy, None, None, ctx.weight_gradient(x, dy, k).to(ctx.dtype), None
