"""Step time, persistent memory and exactness of freezing strategies, on any Keras backend.

Side by side in one run: every variant is built first, warmed up, then timed
in interleaved rounds (A B C ... A B C ...); each round's time is divided by
the full-training time of the same round, and the median ratio with its
min-max spread over rounds is reported.

    python benchmarks/strategies.py                # MLP 6 x Dense(1024), batch 256, Adam
    python benchmarks/strategies.py --model transformer
    python benchmarks/strategies.py --sweep        # compact vs restore by trainable fraction
    KERAS_BACKEND=jax python benchmarks/strategies.py
    KERAS_BACKEND=jax python benchmarks/strategies.py --width 8192 --depth 8 --batch 4096   # on a GPU

Each step is what the backend's trainer runs: a ``tf.function`` (``--xla``:
XLA) on TensorFlow, ``jax.jit`` over the optimizer's ``stateless_apply`` on
JAX (buffers donated, as Keras' JAX trainer does), eager autograd on PyTorch.
Whatever device Keras picks (a GPU when there is one) runs it.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import finefreeze as ff  # noqa: E402

BACKEND = keras.backend.backend()


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(getattr(v.dtype, "name", v.dtype)).itemsize for v in variables)


# -- models written on plain variables, so every recipe can be expressed ------
def mlp_params(rng, width=1024, depth=6):
    params, d = [], width
    for i in range(depth):
        params.append(keras.Variable(rng.normal(0, 0.02, (d, width)).astype("float32"), name=f"k{i}"))
        params.append(keras.Variable(np.zeros(width, "float32"), name=f"b{i}"))
        d = width
    return params


def mlp_forward(params, x):
    h = x
    for i in range(0, len(params), 2):
        z = ops.matmul(h, params[i]) + params[i + 1]
        h = ops.relu(z) if i + 2 < len(params) else z
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
    bsz, t, d = x.shape
    dh = d // heads

    def split(z):
        return ops.transpose(ops.reshape(z, (bsz, t, heads, dh)), (0, 2, 1, 3))

    for b in range(len(params) // per):
        q, k, v, o, f1, f2, g = params[b * per : (b + 1) * per]
        h = x / ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True) + 1e-12) * g
        scores = ops.matmul(split(ops.matmul(h, q)), ops.transpose(split(ops.matmul(h, k)), (0, 1, 3, 2)))
        a = ops.softmax(scores / np.sqrt(dh), axis=-1)
        a = ops.reshape(ops.transpose(ops.matmul(a, split(ops.matmul(h, v))), (0, 2, 1, 3)), (bsz, t, d))
        x = x + ops.matmul(a, o)
        x = x + ops.matmul(ops.relu(ops.matmul(x, f1)), f2)
    return x


MODELS = {
    "mlp": dict(params=mlp_params, forward=mlp_forward, x=None, layers_frozen=None, kernels="re:k\\d"),
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
        return all(np.array_equal(self.before[i][m], value(self.params[i])[m]) for i, m in self.frozen.items())


def value(v) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(v))


def wait(v: Variant) -> None:
    """Block until every queued step of ``v`` has finished (JAX and GPUs run asynchronously)."""
    if BACKEND == "jax":
        import jax

        jax.block_until_ready([x.value for x in v.params + list(v.opt.variables)])
    elif BACKEND == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        value(v.params[-1])


def compile_step(opt, train, others, loss_of, grad_fn=None, xla=False):
    """One training step of ``train`` (the variables ``opt`` updates) as the backend's trainer runs it.

    ``loss_of()`` reads every variable; ``others`` are the variables it reads
    that are not trained (fed to the jitted JAX step as arguments, not baked in).
    """
    grad_fn = grad_fn or (lambda g: g)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function(jit_compile=xla)
        def step():
            with tf.GradientTape() as tape:
                loss = loss_of()
            opt.apply_gradients(zip(grad_fn(tape.gradient(loss, train)), train))

        return step
    if BACKEND == "jax":
        import jax

        opt_vars = list(opt.variables)

        @functools.partial(jax.jit, donate_argnums=(0, 2))
        def pure(train_values, other_values, opt_values):
            def loss_from(tv):
                mapping = list(zip(train, tv)) + list(zip(others, other_values))
                with keras.StatelessScope(state_mapping=mapping):
                    return loss_of()

            grads = jax.grad(loss_from)(train_values)
            with keras.StatelessScope(state_mapping=list(zip(others, other_values))):
                grads = grad_fn(grads)
            return opt.stateless_apply(opt_values, grads, train_values)

        def step():
            new_train, new_opt = pure([v.value for v in train], [v.value for v in others], [v.value for v in opt_vars])
            for v, x in zip(train, new_train):
                v.assign(x)
            for v, x in zip(opt_vars, new_opt):
                v.assign(x)

        return step
    import torch

    def step():
        grads = torch.autograd.grad(loss_of(), [v.value for v in train])
        with torch.no_grad():
            opt.apply_gradients(zip(grad_fn(list(grads)), train))

    return step


def make_variants(model, fraction_sweep=None, xla=False, width=1024, depth=6, batch=256):
    spec = dict(MODELS[model])
    if model == "mlp":
        spec["x"] = (batch, width)
        spec["layers_frozen"] = f"k[0-{depth - 2}]|b[0-{depth - 2}]"
        make_params = functools.partial(mlp_params, width=width, depth=depth)
    else:
        make_params = spec["params"]
    rng = np.random.default_rng(0)
    x = ops.convert_to_tensor(rng.normal(size=spec["x"]).astype("float32"))
    fwd = spec["forward"]

    def loss_of(params):
        return ops.mean(ops.square(fwd(params, x)))

    def fresh():
        return make_params(np.random.default_rng(1))

    def plain(name, sel=None, grad_fn=None, extra=(), frozen=None, forward_params=None):
        params = fresh()
        train = [p for p in params if sel is None or sel(p)]
        opt = keras.optimizers.Adam(1e-4)
        opt.build(train)
        fp = forward_params(params) if forward_params else None
        if callable(frozen):
            frozen = frozen(params)
        extra = extra() if callable(extra) else list(extra)
        trained = {id(p) for p in train}
        others = [p for p in params if id(p) not in trained] + [e for e in extra if isinstance(e, keras.Variable)]
        step = compile_step(opt, train, others, lambda: loss_of(fp() if fp else params), grad_fn, xla)
        return Variant(name, params, step, opt, extra, frozen)

    def planned(name, plan, strategy="auto"):
        params = fresh()
        frz = ff.Freezer(params, plan, strategy=strategy)
        opt = frz.wrap(keras.optimizers.Adam(1e-4))
        tv = frz.trainable_variables
        opt.build(tv)
        others = [p for p in params if all(p is not t for t in tv)]
        step = compile_step(opt, tv, others, lambda: loss_of(params), None, xla)
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
        return [
            keras.Variable((~half(p)).astype("float32"), trainable=False, name="m") if is_kernel(p) else None
            for p in params
        ]

    holder = {}

    def grad_times_mask(grads):
        return [g if m is None else g * m.value for g, m in zip(grads, holder["m"])]

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
        rp["m"] = [
            keras.Variable((~half(p)).astype("float32"), trainable=False, name="m") if is_kernel(p) else None
            for p in params
        ]
        rp["xp"] = [keras.Variable(value(p), trainable=False, name="xp") if is_kernel(p) else None for p in params]

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


def describe(model, width=None, depth=None, batch=None) -> str:
    if model == "mlp":
        return f"MLP {depth} x Dense({width}), batch {batch}"
    return "transformer: 4 pre-LN blocks, d 256, ff 1024, 4 heads, 8 x 128 tokens"


def run(model, rounds, steps, fraction_sweep=None, xla=False, only=None, **sizes):
    variants = make_variants(model, fraction_sweep, xla, **sizes)
    if only:
        variants = [variants[0]] + [v for v in variants[1:] if any(o in v.name for o in only)]
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
            wait(v)
            times[v.name].append((time.perf_counter() - t0) / steps)
    base_mem = full.memory()
    mode = {"tensorflow": "XLA" if xla else "graph", "jax": "jit", "torch": "eager"}[BACKEND]
    device = {"tensorflow": "", "jax": "", "torch": ""}[BACKEND]
    if BACKEND == "jax":
        import jax

        device = f", {jax.devices()[0].platform}"
    print(
        f"\n{describe(model, **sizes)}, {BACKEND} {mode}{device}, Adam; {rounds} interleaved rounds x {steps} steps; "
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
    ap.add_argument("--xla", action="store_true", help="compile the steps with XLA (TensorFlow; JAX always jits)")
    ap.add_argument("--width", type=int, default=1024, help="MLP width (and input size)")
    ap.add_argument("--depth", type=int, default=6, help="MLP layers")
    ap.add_argument("--batch", type=int, default=256, help="MLP batch")
    ap.add_argument(
        "--only", help="comma-separated parts of variant names to run beside full training, e.g. '1%%,50%%: restore'"
    )
    ap.add_argument("--sweep", action="store_true", help="compact vs restore by trainable fraction")
    a = ap.parse_args()
    sweep = [0.01, 0.05, 0.1, 0.2, 0.3] if a.sweep else None
    sizes = dict(width=a.width, depth=a.depth, batch=a.batch) if a.model == "mlp" else {}
    only = a.only.split(",") if a.only else None
    run(a.model, a.rounds, a.steps, sweep, a.xla, only, **sizes)


if __name__ == "__main__":
    main()
