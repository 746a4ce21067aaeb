"""What frozen elements cost: new embedding rows, per strategy, against the embedding frozen whole.

Model: token ids (batch 192 × 32) -> Embedding(60,000 × 128) -> mean over
the sequence -> Dense(10); Adam; a custom step (``tf.function`` on
TensorFlow, ``jax.jit`` on JAX, eager on PyTorch — Keras' own ``fit`` step).
Variants, each with its own model and optimizer, built and warmed up first,
then timed in interleaved rounds (A B C D, A B C D, ...):

- ``frozen``: the embedding frozen whole, the head trains (the floor: what
  the step costs with no gradient for the table at all);
- ``restore``, ``compact`` and ``auto``: the last 100 rows and the head
  train, the table's gradient the whole table's;
- ``sliced``: the same with ``gradients="sliced"``: the gradient of the 100
  rows only;
- ``full``: the whole table and the head train (plain Keras).

Per variant: median step time over rounds divided by the ``frozen`` step of
the same round (min-max over rounds), the optimizer's variables in elements
(finefreeze's masks and index vectors included) as a share of Adam's dense
state of the table, and whether the frozen rows stayed bit-identical. One
thread per process by default (ratios are stable then; ``--threads 0`` for
the framework's default).

    python benchmarks/cost.py [--rounds 7] [--steps 10] [--rows 100] [--threads 1]
    python benchmarks/cost.py --vocab 600000 --only sliced,compact   # a table ten times larger
    KERAS_BACKEND=jax python benchmarks/cost.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def threads(n: int) -> None:
    if n <= 0:
        return
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)
    elif backend == "torch":
        import torch

        torch.set_num_threads(n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=100, help="new rows that train")
    ap.add_argument("--vocab", type=int, default=60_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated variants (frozen always runs)")
    a = ap.parse_args()
    threads(a.threads)

    import keras
    import numpy as np

    import finefreeze as ff

    rng = np.random.default_rng(0)
    x = rng.integers(0, a.vocab, (192, 32)).astype("int32")
    x[:, :4] = rng.integers(a.vocab - a.rows, a.vocab, (192, 4))  # every batch uses new tokens
    y = rng.integers(0, 10, 192).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model():
        keras.utils.set_random_seed(0)
        i = keras.Input((32,), dtype="int32")
        h = keras.layers.Embedding(a.vocab, a.dim, name="token_embedding")(i)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(i, keras.layers.Dense(10, name="head")(h))

    new_rows = f"token_embedding/embeddings[{a.vocab - a.rows}:]"
    plans = {
        "frozen": (ff.Plan([ff.freeze("token_embedding/**")]), "auto", "dense"),
        "restore": (ff.Plan([ff.freeze("token_embedding/**"), ff.train(new_rows)]), "restore", "dense"),
        "compact": (ff.Plan([ff.freeze("token_embedding/**"), ff.train(new_rows)]), "compact", "dense"),
        "auto": (ff.Plan([ff.freeze("token_embedding/**"), ff.train(new_rows)]), "auto", "dense"),
        "sliced": (ff.Plan([ff.freeze("token_embedding/**"), ff.train(new_rows)]), "auto", "sliced"),
        "full": (None, None, None),
    }
    only = {v.strip() for v in a.only.split(",") if v.strip()}
    plans = {k: v for k, v in plans.items() if k == "frozen" or not only or k in only}
    variants, info = {}, {}
    for name, (plan, strategy, gradients) in plans.items():
        m = model()
        before = np.array(keras.ops.convert_to_numpy(m.get_layer("token_embedding").embeddings), copy=True)
        if plan is None:
            opt = keras.optimizers.Adam(1e-3)
            frz = None
        else:
            frz = ff.Freezer(m, plan, strategy=strategy, gradients=gradients)
            opt = frz.wrap(keras.optimizers.Adam(1e-3))
        m.compile(optimizer=opt, loss=loss_fn)
        m.train_on_batch(x, y)  # builds, traces, warms up
        m.train_on_batch(x, y)
        variants[name] = m
        info[name] = (frz, before, opt)
    ratios = {k: [] for k in variants}
    floor_ms = []
    for _ in range(a.rounds):
        got = {}
        for name, m in variants.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                m.train_on_batch(x, y)
            got[name] = (time.perf_counter() - t0) / a.steps
        floor_ms.append(1000 * got["frozen"])
        for k, v in got.items():
            ratios[k].append(v / got["frozen"])
    dense = 2 * a.vocab * a.dim
    print(
        f"## {keras.backend.backend()}: Embedding({a.vocab:,} x {a.dim}) + head, {a.rows} new rows train, "
        f"batch 192 x 32, Adam, {a.threads or 'default'} thread(s); frozen step {statistics.median(floor_ms):.1f} ms\n"
    )
    print(
        "| variant | strategy | step / frozen step | optimizer elements / dense Adam state of the table | frozen rows |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, r in ratios.items():
        frz, before, opt = info[name]
        state = sum(int(np.prod(v.shape)) for v in opt.variables) - 1  # without the step count
        table = np.asarray(keras.ops.convert_to_numpy(variants[name].get_layer("token_embedding").embeddings))
        kept = np.array_equal(table[: a.vocab - a.rows], before[: a.vocab - a.rows])
        kind = (
            next(v["strategy"] for v in frz.report()["variables"] if v["path"].endswith("token_embedding/embeddings"))
            if frz is not None
            else "plain Keras"
        )
        kind = f"{kind} (sliced)" if name == "sliced" else kind
        print(
            f"| {name} | {kind} | {statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f}) | "
            f"{100 * state / dense:.2f} % | {'bit-identical' if kept else 'moved'} |"
        )


if __name__ == "__main__":
    main()
