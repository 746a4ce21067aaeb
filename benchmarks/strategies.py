"""Step time, persistent memory and exactness of freezing strategies.

Side by side in one run: every variant is built first, warmed up, then timed
in interleaved rounds (A B C ... A B C ...); each round's time is divided by
the full-training time of the same round, and the median ratio with its
min-max spread over rounds is reported.

    python benchmarks/strategies.py                # MLP 6 x Dense(1024), batch 256, Adam
    python benchmarks/strategies.py --model transformer
    python benchmarks/strategies.py --sweep        # compact vs restore by trainable fraction
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(getattr(v.dtype, "name", v.dtype)).itemsize for v in variables)


# -- models written on plain variables, so every recipe can be expressed ------
def mlp_params(rng, width=1024, depth=6, d_in=1024):
    params, d = [], d_in
    for i in range(depth):
        params.append(keras.Variable(rng.normal(0, 0.02, (d, width)).astype("float32"), name=f"k{i}"))
        params.append(keras.Variable(np.zeros(width, "float32"), name=f"b{i}"))
        d = width
    return params


def mlp_forward(params, x):
    h = x
    for i in range(0, len(params), 2):
        h = tf.nn.relu(h @ params[i] + params[i + 1]) if i + 2 < len(params) else h @ params[i] + params[i + 1]
    return h


def tfm_params(rng, d=256, ff_dim=1024, blocks=4):
    params = []
    for b in range(blocks):
        for name, shape in [
            ("q", (d, d)),
            ("k", (d, d)),
            ("v", (d, d)),
            ("o", (d, d)),
            ("f1", (d, ff_dim)),
            ("f2", (ff_dim, d)),
        ]:
            params.append(keras.Variable(rng.normal(0, 0.02, shape).astype("float32"), name=f"blk{b}_{name}"))
        params.append(keras.Variable(np.ones(d, "float32"), name=f"blk{b}_ln_g"))
    return params


def tfm_forward(params, x, heads=4):
    per = 7
    for b in range(len(params) // per):
        q, k, v, o, f1, f2, g = params[b * per : (b + 1) * per]
        h = tf.nn.l2_normalize(x, -1) * g
        bsz, t, d = tf.shape(h)[0], tf.shape(h)[1], h.shape[-1]

        def split(z, bsz=bsz, t=t, d=d):
            return tf.transpose(tf.reshape(z, (bsz, t, heads, d // heads)), (0, 2, 1, 3))

        a = tf.nn.softmax(tf.matmul(split(h @ q), split(h @ k), transpose_b=True) / np.sqrt(d // heads))
        a = tf.reshape(tf.transpose(tf.matmul(a, split(h @ v)), (0, 2, 1, 3)), (bsz, t, d))
        x = x + a @ o
        x = x + tf.nn.relu(x @ f1) @ f2
    return x


MODELS = {
    "mlp": dict(
        params=mlp_params, forward=mlp_forward, x=(256, 1024), layers_frozen="k[0-4]|b[0-4]", kernels="re:k\\d"
    ),
    "transformer": dict(
        params=tfm_params,
        forward=tfm_forward,
        x=(8, 128, 256),
        layers_frozen="blk[0-2]_.*",
        kernels="re:blk\\d_(q|k|v|o|f1|f2)",
    ),
}


class Variant:
    def __init__(self, name, params, step, opt, extra=(), frozen=None):
        self.name, self.params, self.step, self.opt = name, params, step, opt
        self.extra = list(extra)
        self.frozen = frozen or {}  # index -> bool mask of frozen elements
        self.before = {i: np.array(params[i].numpy(), copy=True) for i in self.frozen}

    def memory(self) -> int:
        return nbytes(self.params) + nbytes(self.opt.variables) + nbytes(self.extra)

    def exact(self) -> bool:
        return all(
            np.array_equal(self.before[i][m], np.asarray(self.params[i].numpy())[m]) for i, m in self.frozen.items()
        )


def make_variants(model, fraction_sweep=None, xla=False):
    spec = MODELS[model]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=spec["x"]).astype("float32"))
    fwd = spec["forward"]

    def loss_of(params):
        return tf.reduce_mean(tf.square(fwd(params, x)))

    def fresh():
        return spec["params"](np.random.default_rng(1))

    def plain(name, sel=None, grad_fn=None, extra=(), frozen=None, forward_params=None):
        params = fresh()
        train = [p for p in params if sel is None or sel(p)]
        opt = keras.optimizers.Adam(1e-4)
        opt.build(train)
        fp = forward_params(params) if forward_params else None
        if callable(frozen):
            frozen = frozen(params)

        @tf.function(jit_compile=xla)
        def step():
            with tf.GradientTape() as tape:
                loss = loss_of(fp() if fp else params)
            grads = tape.gradient(loss, train)
            if grad_fn:
                grads = grad_fn(grads)
            opt.apply_gradients(zip(grads, train))

        return Variant(name, params, step, opt, extra() if callable(extra) else extra, frozen)

    def planned(name, plan, strategy="auto"):
        params = fresh()
        frz = ff.Freezer(params, plan, strategy=strategy)
        opt = frz.wrap(keras.optimizers.Adam(1e-4))
        tv = frz.trainable_variables
        opt.build(tv)

        @tf.function(jit_compile=xla)
        def step():
            with tf.GradientTape() as tape:
                loss = loss_of(params)
            opt.apply_gradients(zip(tape.gradient(loss, tv), tv))

        frozen = {i: frz.frozen_mask(p.path) for i, p in enumerate(params) if frz.variable_state(p.path) != "trainable"}
        return Variant(name, params, step, opt, frozen=frozen)

    import re

    layer_rx = re.compile(spec["layers_frozen"])
    kern_rx = re.compile(spec["kernels"][3:])
    is_kernel = lambda p: bool(kern_rx.fullmatch(p.path))  # noqa: E731
    half = lambda p: np.broadcast_to((np.arange(p.shape[0]) % 2 == 0)[:, None], p.shape)  # noqa: E731

    variants = [plain("full training")]
    if fraction_sweep:
        for frac in fraction_sweep:
            rows = lambda p, f=frac: max(1, int(round(p.shape[0] * f)))  # noqa: E731
            plan_f = ff.Plan([ff.freeze("**")] + [ff.train(f"{p.path}[:{rows(p)}]") for p in fresh() if is_kernel(p)])
            variants.append(planned(f"{frac:.0%} trainable, restore", plan_f, "restore"))
            variants.append(planned(f"{frac:.0%} trainable, compact", plan_f, "compact"))
        return variants

    variants.append(
        plain(
            "freeze layers by var_list",
            sel=lambda p: not layer_rx.fullmatch(p.path),
            frozen=lambda ps: {i: np.ones(p.shape, bool) for i, p in enumerate(ps) if layer_rx.fullmatch(p.path)},
        )
    )
    variants.append(planned("freeze layers by plan", ff.Plan([ff.freeze("re:" + spec["layers_frozen"])])))
    plan50 = ff.Plan([ff.freeze(p.path + "[::2]") for p in fresh() if is_kernel(p)])
    variants.append(planned("50%: restore", plan50, "restore"))
    variants.append(planned("50%: compact", plan50, "compact"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants.append(planned("50%: mask (inexact)", plan50, "mask"))

    def masks_for(params):
        return [tf.constant((~half(p)).astype("float32")) if is_kernel(p) else None for p in params]

    holder = {}

    def grad_times_mask(grads):
        return [g if m is None else g * m for g, m in zip(grads, holder["m"])]

    v = plain(
        "50%: gradient x float mask",
        grad_fn=grad_times_mask,
        extra=lambda: [m for m in holder["m"] if m is not None],
        frozen=lambda ps: (
            holder.setdefault("m", masks_for(ps)),
            {i: half(p) for i, p in enumerate(ps) if is_kernel(p)},
        )[1],
    )
    variants.append(v)

    rp = {}

    def reparam_params(params):
        rp["m"] = [tf.Variable((~half(p)).astype("float32"), trainable=False) if is_kernel(p) else None for p in params]
        rp["xp"] = [tf.Variable(p.numpy(), trainable=False) if is_kernel(p) else None for p in params]

        def eff():
            return [p if m is None else m * p + (1 - m) * xp for p, m, xp in zip(params, rp["m"], rp["xp"])]

        return eff

    variants.append(
        plain(
            "50%: reparametrization",
            forward_params=reparam_params,
            extra=lambda: [t for t in rp["m"] + rp["xp"] if t is not None],
        )
    )
    plan1 = ff.Plan(
        [ff.freeze("**")] + [ff.train(f"{p.path}[:{max(1, p.shape[0] // 100)}]") for p in fresh() if is_kernel(p)]
    )
    variants.append(planned("1%: compact", plan1, "compact"))
    variants.append(planned("1%: restore", plan1, "restore"))
    return variants


def run(model, rounds, steps, fraction_sweep=None, xla=False):
    variants = make_variants(model, fraction_sweep, xla)
    full = variants[0]
    for v in variants:  # warm up: trace and run a few steps
        for _ in range(3):
            v.step()
    times = {v.name: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            t0 = time.perf_counter()
            for _ in range(steps):
                v.step()
            _ = v.params[0].numpy()[0, 0]  # wait for the last step
            times[v.name].append((time.perf_counter() - t0) / steps)
    base_mem = full.memory()
    mode = "XLA" if xla else "graph"
    print(
        f"\n{model}, {mode} mode, Adam; {rounds} interleaved rounds x {steps} steps; "
        f"full training step {statistics.median(times[full.name]) * 1e3:.1f} ms (median)"
    )
    print(f"{'variant':38s} {'step time vs full':>22s} {'persistent memory vs full':>26s} {'exact':>6s}")
    for v in variants:
        ratios = [t / f for t, f in zip(times[v.name], times[full.name])]
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        exact = "-" if not v.frozen else ("yes" if v.exact() else "NO")
        print(f"{v.name:38s} {spread:>22s} {v.memory() / base_mem:>26.3f} {exact:>6s}")
        inner = getattr(v.opt, "inner_optimizer", v.opt)
        opt_state = nbytes([x for x in inner.variables if len(x.shape) > 0])
        full_state = nbytes([x for x in full.opt.variables if len(x.shape) > 0])
        if "compact" in v.name:
            print(f"{'':38s}   inner optimizer state vs full: {opt_state / full_state:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="mlp")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--xla", action="store_true", help="compile the steps with XLA")
    ap.add_argument("--sweep", action="store_true", help="compact vs restore by trainable fraction")
    a = ap.parse_args()
    sweep = [0.01, 0.05, 0.1, 0.2, 0.3] if a.sweep else None
    run(a.model, a.rounds, a.steps, sweep, a.xla)


if __name__ == "__main__":
    main()
