"""The hand-written freezing recipes in plain JAX, beside full training: what finefreeze should match on JAX.

    KERAS_BACKEND=jax python benchmarks/jax_recipes.py
    python benchmarks/jax_recipes.py --width 8192 --depth 8 --batch 4096     # the H200 setting

An MLP of ``depth`` Dense(width) layers with ReLU, plain SGD on a mean-square
loss, one ``jax.jit`` step with donated buffers per variant:

- full: every element trains;
- where-restore 50 %: ``jnp.where(frozen, w, w - lr * g)`` with a bool mask;
- compact 1 %: the trainable 1 % gathered (``take``), updated, scattered back
  (``.at[idx].set``).

Variants run in interleaved rounds after a warm-up; the median ratio to the
full step of the same round is printed with its min-max spread. The same
sizes in ``benchmarks/strategies.py`` give finefreeze's ratios on JAX.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np


def main() -> None:
    import jax
    import jax.numpy as jnp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    n, lr = a.width, 1e-4
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(a.batch, n)).astype(np.float32))
    half = jnp.asarray(np.broadcast_to((np.arange(n) % 2 == 0)[:, None], (n, n)))
    idx = [
        jnp.asarray(np.sort(rng.choice(n * n, n * n // 100, replace=False)).astype(np.int32)) for _ in range(a.depth)
    ]

    def loss(ws):
        h = x
        for w in ws:
            h = jax.nn.relu(h @ w)
        return jnp.mean(h * h)

    @partial(jax.jit, donate_argnums=0)
    def full(ws):
        return [w - lr * g for w, g in zip(ws, jax.grad(loss)(ws))]

    @partial(jax.jit, donate_argnums=0)
    def where_restore(ws):
        return [jnp.where(half, w, w - lr * g) for w, g in zip(ws, jax.grad(loss)(ws))]

    @partial(jax.jit, donate_argnums=0)
    def compact(ws):
        out = []
        for w, g, i in zip(ws, jax.grad(loss)(ws), idx):
            flat = w.reshape(-1)
            new = jnp.take(flat, i) - lr * jnp.take(g.reshape(-1), i)
            out.append(flat.at[i].set(new).reshape(w.shape))
        return out

    variants = {"full": full, "where-restore 50%": where_restore, "compact 1%": compact}
    state = {k: [jnp.asarray(rng.normal(0, 0.03, (n, n)).astype(np.float32)) for _ in range(a.depth)] for k in variants}
    for k, f in variants.items():  # compile and warm up
        for _ in range(3):
            state[k] = f(state[k])
        jax.block_until_ready(state[k])
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        for k, f in variants.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                state[k] = f(state[k])
            jax.block_until_ready(state[k])
            times[k].append((time.perf_counter() - t0) / a.steps)
    dev = jax.devices()[0].platform
    print(f"plain JAX on {dev}: MLP {a.depth} x Dense({n}), batch {a.batch}, SGD; {a.rounds} rounds x {a.steps} steps")
    print(f"full step {statistics.median(times['full']) * 1e3:.1f} ms (median)")
    for k in variants:
        r = [t / f for t, f in zip(times[k], times["full"])]
        print(f"{k:20s} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")


if __name__ == "__main__":
    main()
