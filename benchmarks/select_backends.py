"""Seconds of ``ff.select(..., score="fisher", budget=0.01)`` on the digits problem, per Keras backend.

The model and data of ``benchmarks/sparse.py``: the pretrained digits base
(1,148,960 parameters) with a new head, the 250 labelled training images of
the target task, batch 32, microbatch 16. The head's weights are drawn with
numpy, so every backend scores the same weights; the script checks that
every backend chose the same elements. Each backend runs in its own process
(Keras picks its backend once per process); each ``per_example`` mode is
timed ``--repeats`` times in a row, the first run including the tracing or
compiling. Prints a Markdown table.

    python benchmarks/select_backends.py [--backends tensorflow,jax,torch] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def child(modes: list[str], repeats: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import finefreeze as ff
    from finefreeze._data.digits import pretrained_digits_model, target_task

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = pretrained_digits_model(seed=0)
    rng = np.random.default_rng(0)  # Keras' initializers draw differently on each backend
    for v in model.weights:
        if v.path.startswith("head/"):
            v.assign(rng.normal(scale=0.1, size=v.shape).astype("float32"))
    (x, y), _ = target_task(0)
    out = {}
    for mode in modes:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            plan = ff.select(
                model,
                (x, y),
                budget=0.01,
                score="fisher",
                include="head/**",
                loss=loss,
                options={"per_example": mode, "verbose": 0},
            )
            times.append(time.perf_counter() - t)
        frz = ff.Freezer(model, plan)
        chosen = np.concatenate(
            [np.flatnonzero(~frz.frozen_mask(v.path)) + 10**7 * i for i, v in enumerate(model.weights)]
        )
        out[mode] = {"times": times, "chosen": chosen.tolist()}
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="tensorflow,jax,torch")
    ap.add_argument("--modes", default="auto,loop")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for b in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=b, PYTHONPATH=os.path.join(root, "src"))
        cmd = [sys.executable, __file__, CHILD, args.modes, str(args.repeats)]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"{b}: {got.stderr[-2000:]}")
        results[b] = json.loads(got.stdout.strip().splitlines()[-1])
    print("| backend | per_example | first run (s) | then (s, median) |")
    print("|---|---|---:|---:|")
    for b, r in results.items():
        for mode, m in r.items():
            rest = m["times"][1:] or m["times"]
            print(f"| {b} | {mode} | {m['times'][0]:.2f} | {statistics.median(rest):.2f} |")
    chosen = [m["chosen"] for r in results.values() for m in r.values()]
    same = all(c == chosen[0] for c in chosen)
    print(f"\nthe same {len(chosen[0]):,} elements chosen on every backend and mode: {same}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2].split(","), int(sys.argv[3]))
    else:
        main()
