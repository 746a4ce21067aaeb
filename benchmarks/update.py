"""What a plan change costs, in units of one training step.

An MLP of 6 x Dense(1024) (6.3 M parameters, batch 256, AdamW, `fit`-style
`train_on_batch`) alternates between two plans of each kind, in interleaved
rounds; every timing is divided by the median step time of the same round.

- element-mask change: the last kernel stays partially frozen (restore), a
  different half of it trains: masks are assigned in place, no retrace;
- variable-level change: layer 5 is frozen, then released: slots rebuilt
  (state carried element by element) and the train function retraced.

Reported per kind: the `update()` call, and the first step after it (which
pays for any retrace), as medians with the min-max spread over rounds.

    python benchmarks/update.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402


def model():
    keras.utils.set_random_seed(0)
    layers = [keras.Input((1024,))]
    layers += [keras.layers.Dense(1024, activation="relu", name=f"d{i}") for i in range(5)]
    layers.append(keras.layers.Dense(1024, name="d5"))
    return keras.Sequential(layers, name="mlp")


HALF_A = ff.Plan([ff.freeze("**/d5/kernel[:512]")])
HALF_B = ff.Plan([ff.freeze("**/d5/kernel[512:]")])
LAYER_FROZEN = ff.Plan([ff.freeze("**/d5/kernel[:512]"), ff.freeze("**/d4/**")])


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps timed per round for the step baseline")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 1024)).astype("float32")
    y = rng.normal(size=(256, 1024)).astype("float32")
    m = model()
    frz = ff.Freezer(m, HALF_A, strategy="restore")
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-4)), loss="mse")
    for _ in range(3):  # warm up both plans of both kinds once
        m.train_on_batch(x, y)
    for plan in (HALF_B, HALF_A, LAYER_FROZEN, HALF_A):
        frz.update(plan)
        m.train_on_batch(x, y)
    results = {k: [] for k in ("mask: update()", "mask: next step", "variable: update()", "variable: next step")}
    steps = []
    for _ in range(args.rounds):
        step = statistics.median(timed(lambda: m.train_on_batch(x, y)) for _ in range(args.steps))
        steps.append(step)
        for kind, plans in (("mask", (HALF_B, HALF_A)), ("variable", (LAYER_FROZEN, HALF_A))):
            for plan in plans:
                results[f"{kind}: update()"].append(timed(lambda plan=plan: frz.update(plan)) / step)
                results[f"{kind}: next step"].append(timed(lambda: m.train_on_batch(x, y)) / step)
    frz.verify()
    retraced = [h["retraced"] for h in frz.history[-4:]]
    assert retraced == [False, False, True, True], retraced
    print(f"step (median over rounds): {1000 * statistics.median(steps):.1f} ms")
    print("| change | cost in steps (median) | spread |")
    print("|---|---|---|")
    for k, v in results.items():
        print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f}-{max(v):.2f} |")


if __name__ == "__main__":
    main()
