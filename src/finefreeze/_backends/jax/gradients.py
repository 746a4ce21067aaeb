"""Per-example gradients of ``select`` on JAX: ``jax.vmap(jax.grad(...))`` or a ``lax.scan``, jitted once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from finefreeze._backends.accumulate import Grads, as_arrays, one_example, others_of, pure_loss

__all__ = ["Gradients"]


class Gradients(Grads):
    def __init__(self, model, variables, loss_fn, mode):
        others = others_of(model, variables)
        f = pure_loss(model, variables, others, loss_fn)
        self.variables, self.others = variables, others
        self.accs = [jnp.zeros(v.shape, jnp.float32) for v in variables]

        def batch_grads(values, ovals, x, y):
            return jax.grad(lambda v: f(v, ovals, x, y, False)[0])(values)

        def example_grads(values, ovals, xi, yi):
            return batch_grads(values, ovals, one_example(xi), one_example(yi))

        def gradient_step(accs, values, ovals, x, y):
            return [a + jnp.abs(g.astype(jnp.float32)) for a, g in zip(accs, batch_grads(values, ovals, x, y))]

        def fisher_step(accs, values, ovals, x, y):
            if mode == "loop":

                def body(acc, xy):
                    g = example_grads(values, ovals, *xy)
                    return [a + jnp.square(gi.astype(jnp.float32)) for a, gi in zip(acc, g)], None

                return jax.lax.scan(body, accs, (x, y))[0]
            g = jax.vmap(example_grads, in_axes=(None, None, 0, 0))(values, ovals, x, y)
            return [a + jnp.sum(jnp.square(gi.astype(jnp.float32)), axis=0) for a, gi in zip(accs, g)]

        jitted = {
            "gradient": jax.jit(gradient_step, donate_argnums=0),
            "fisher": jax.jit(fisher_step, donate_argnums=0),
        }

        def run(kind):
            def go(x, y):
                values = [v.value for v in self.variables]
                ovals = [v.value for v in self.others]
                self.accs[:] = jitted[kind](list(self.accs), values, ovals, x, y)

            return go

        self._steps = {"gradient": run("gradient"), "fisher": run("fisher")}

    def _inputs(self, x, y):
        return as_arrays(x), as_arrays(y)

    @staticmethod
    def _zeros(a):
        return jnp.zeros(a.shape, jnp.float32)

    @staticmethod
    def _numpy(a, copy):
        return np.array(a, np.float32, copy=True)  # np.asarray of a jax array is read-only

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        others = others_of(model, variables)
        f = pure_loss(model, variables, others, loss_fn)
        grads = jax.jit(lambda values, ovals, x, y: jax.grad(lambda v: f(v, ovals, x, y, True), has_aux=True)(values))

        def step(x, y):
            g, new = grads([v.value for v in variables], [v.value for v in others], as_arrays(x), as_arrays(y))
            for v, n in zip(others, new):  # state the call changed (seeds, BatchNormalization statistics)
                v.assign(n)
            optimizer.apply(g, variables)

        return step
