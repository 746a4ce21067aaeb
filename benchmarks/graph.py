"""Step time, persistent memory and exactness of freezing in tf.compat.v1 graph code.

Side by side in one run: every variant is built in its own graph and session,
warmed up, then timed in interleaved rounds (A B C ... A B C ...); each
round's time is divided by the full-training time of the same round, and the
median ratio with its min-max spread over rounds is reported.

    python benchmarks/graph.py                     # MLP 6 x Dense(1024), batch 256, Adam
    python benchmarks/graph.py --optimizer momentum --rounds 9 --threads 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402

v1 = tf.compat.v1
OPTIMIZERS = {
    "adam": lambda: v1.train.AdamOptimizer(1e-3),
    "momentum": lambda: v1.train.MomentumOptimizer(1e-2, 0.9),
    "sgd": lambda: v1.train.GradientDescentOptimizer(1e-2),
}


class Variant:
    """One way to train, in its own graph and session."""

    def __init__(self, name, build, depth, width, batch, optimizer, threads=0):
        self.name = name
        rng = np.random.default_rng(0)
        self.graph = tf.Graph()
        with self.graph.as_default():
            x = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
            y = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
            self.params, h = [], x
            for i in range(depth):
                with v1.variable_scope(f"layer_{i}"):
                    k = v1.get_variable("kernel", initializer=rng.normal(0, 0.02, (width, width)).astype("float32"))
                    b = v1.get_variable("bias", initializer=np.zeros(width, "float32"))
                self.params += [k, b]
                h = h @ k + b
                h = tf.nn.relu(h) if i + 1 < depth else h
            loss = tf.reduce_mean(tf.square(h - y))
            self.frozen = {}  # variable -> bool mask of its frozen elements (for the exactness check)
            self.op, self.extra_bytes = build(self, optimizer(), loss)
            config = v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads)
            self.sess = v1.Session(graph=self.graph, config=config)
            self.sess.run(v1.global_variables_initializer())
            self.start = self.sess.run(list(self.frozen))

    def memory(self) -> int:
        """Bytes of every variable (weights, slots, copies) plus the masks the variant keeps."""
        variables = self.graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
        return sum(int(np.prod(v.shape)) * v.dtype.size for v in variables) + self.extra_bytes

    def exact(self) -> bool:
        now = self.sess.run(list(self.frozen))
        return all(np.array_equal(a[m], b[m]) for a, b, m in zip(now, self.start, self.frozen.values()))

    def time(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.sess.run(self.op)
        return (time.perf_counter() - t0) / steps


def _half_masks(v):
    """50 % of every kernel frozen (every other row); biases train."""
    out = {}
    for k in v.params[0::2]:
        m = np.zeros(k.shape, bool)
        m[::2] = True
        out[k] = m
    return out


def full(v, opt, loss):
    return opt.minimize(loss), 0


def layers_by_var_list(v, opt, loss):
    v.frozen = {p: np.ones(p.shape, bool) for p in v.params[:-2]}
    return opt.minimize(loss, var_list=v.params[-2:]), 0


def layers_by_plan(v, opt, loss):
    last = len(v.params) // 2 - 1
    frz = ff.tf1.Freezer(v.graph, ff.Plan([ff.freeze("**"), ff.train(f"layer_{last}/**")]))
    v.frozen = {p: np.ones(p.shape, bool) for p in v.params[:-2]}
    return frz.minimize(opt, loss), 0


def half_by_plan(v, opt, loss):
    v.frozen = _half_masks(v)
    rules = [ff.freeze(k, mask=m) for k, m in v.frozen.items()]
    return ff.tf1.Freezer(v.graph, ff.Plan(rules)).minimize(opt, loss), sum(m.size for m in v.frozen.values())


def half_grad_times_mask(v, opt, loss):
    """The TF1 folk recipe: gradient x float 0/1 mask (inexact with momentum or Adam)."""
    v.frozen = _half_masks(v)
    grads = opt.compute_gradients(loss, var_list=v.params)
    masked = [(g * (1.0 - v.frozen[p]).astype("float32") if p in v.frozen else g, p) for g, p in grads]
    return opt.apply_gradients(masked), 4 * sum(m.size for m in v.frozen.values())


def half_by_hand_assign(v, opt, loss):
    """The exact TF1 recipe by hand: gradient x mask, apply, tf.assign the frozen values from a copy."""
    v.frozen = _half_masks(v)
    copies = {p: v1.Variable(p.initial_value, trainable=False) for p in v.frozen}
    grads = opt.compute_gradients(loss, var_list=v.params)
    masked = [(g * (1.0 - v.frozen[p]).astype("float32") if p in v.frozen else g, p) for g, p in grads]
    with tf.control_dependencies([opt.apply_gradients(masked)]):
        pins = [v1.assign(p, tf.where(m, copies[p], p.read_value())) for p, m in v.frozen.items()]
    return tf.group(*pins), 5 * sum(m.size for m in v.frozen.values())


VARIANTS = {
    "full training": full,
    "freeze 5 of 6 layers by `var_list`": layers_by_var_list,
    "freeze 5 of 6 layers by plan (`frz.minimize`)": layers_by_plan,
    "50 %: `frz.minimize`": half_by_plan,
    "50 %: gradient × float mask (folk recipe)": half_grad_times_mask,
    "50 %: gradient × mask + `tf.assign` from a copy": half_by_hand_assign,
}


def run(args) -> list[tuple]:
    variants = [
        Variant(n, b, args.depth, args.width, args.batch, OPTIMIZERS[args.optimizer], args.threads)
        for n, b in VARIANTS.items()
    ]
    for v in variants:
        v.time(3)  # warm-up
    ratios = {v.name: [] for v in variants}
    base_times = []
    for _ in range(args.rounds):
        order = variants[:]
        random.shuffle(order)
        times = {v.name: v.time(args.steps) for v in order}
        base = times["full training"]
        base_times.append(base)
        for name, t in times.items():
            ratios[name].append(t / base)
    mem0 = variants[0].memory()
    rows = []
    for v in variants:
        r = ratios[v.name]
        exact = "–" if not v.frozen else ("yes" if v.exact() else "**no**")
        rows.append((v.name, statistics.median(r), min(r), max(r), v.memory() / mem0, exact))
    for v in variants:
        v.sess.close()
    print(f"full step {1000 * statistics.median(base_times):.1f} ms")
    print("| variant | step time vs full | persistent memory vs full | exact |")
    print("| --- | --- | --- | --- |")
    for name, med, lo, hi, mem, exact in rows:
        spread = "" if name == "full training" else f" ({lo:.2f}–{hi:.2f})"
        print(f"| {name} | {med:.2f}{spread} | {mem:.3f} | {exact} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="threads per session (0: TensorFlow's default)")
    random.seed(0)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
