"""Per-example gradients of ``select`` on TensorFlow: ``tf.GradientTape``, ``tf.vectorized_map`` or ``tf.map_fn``."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from finefreeze._backends.accumulate import Grads, one_example

__all__ = ["Gradients"]


class Gradients(Grads):
    def __init__(self, model, variables, loss_fn, mode):
        watched = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        accs = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False) for v in variables]
        self.accs = accs

        def grads(x, y):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                out = loss_fn(y, model(x, training=False))
            return [
                tf.zeros(w.shape, tf.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
                for g, w in zip(tape.gradient(out, watched), watched)  # embeddings: IndexedSlices made dense
            ]

        @tf.function(reduce_retracing=True)
        def gradient_step(x, y):
            for a, g in zip(accs, grads(x, y)):
                a.assign_add(tf.abs(g))

        def fisher_step(loop: bool):
            @tf.function(reduce_retracing=True)
            def step(x, y):
                def one(xy):
                    xi, yi = xy
                    return [tf.square(g) for g in grads(one_example(xi), one_example(yi))]

                if loop:  # each example's squares added as its gradients come: no stacked batch, no sum of it

                    def add(xy):
                        for a, square in zip(accs, one(xy)):
                            a.assign_add(square)
                        return tf.constant(0, tf.int32)

                    tf.map_fn(add, (x, y), fn_output_signature=tf.int32)
                    return
                squares = tf.vectorized_map(one, (x, y), fallback_to_while_loop=True)
                sums = [tf.reduce_sum(sq, axis=0) for sq in squares]
                with tf.control_dependencies(sums):  # no accumulator changes unless every gradient was taken
                    for a, total in zip(accs, sums):
                        a.assign_add(total)

            return step

        self._steps = {"gradient": gradient_step, "fisher": fisher_step(mode == "loop")}
        self._loop = lambda: fisher_step(True)
        self.mode = mode

    def add(self, kind: str, x, y) -> None:
        if kind != "fisher" or self.mode != "auto":
            return super().add(kind, x, y)
        try:
            self._steps["fisher"](x, y)
            self.mode = "vectorized"  # it worked once: it works for every microbatch
        except (tf.errors.OpError, ValueError, NotImplementedError):  # pfor cannot take an op of the model
            self._steps["fisher"] = self._loop()
            self.mode = "loop"
            self._steps["fisher"](x, y)

    def reset(self):
        for a in self.accs:
            a.assign(np.zeros(a.shape, np.float32))

    @staticmethod
    def _numpy(a, copy):
        return a.numpy()  # always a copy

    @staticmethod
    def train_step(model, variables, loss_fn, optimizer):
        watched = [v.value if isinstance(v, keras.Variable) else v for v in variables]

        @tf.function(reduce_retracing=True)
        def step(x, y):
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(watched)
                out = loss_fn(y, model(x, training=True))
            g = tape.gradient(out, watched)
            optimizer.apply([tf.zeros_like(w) if gi is None else gi for gi, w in zip(g, watched)], variables)

        return step
