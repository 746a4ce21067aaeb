"""Resolution cost: a plan of 20 rules against a model of 10,000 variables,
next to the cost of building that model.

    python benchmarks/resolution.py
    python benchmarks/resolution.py --profile   # and where the time goes (cProfile, top functions)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402

N_LAYERS = 5000  # Dense layers: kernel + bias = 10,000 variables


def build_model():
    inp = keras.Input((4,))
    outs = []
    for b in range(N_LAYERS // 100):  # 50 branches of 100 layers: graph depth stays small
        x = inp
        for i in range(100):
            x = keras.layers.Dense(4, name=f"block_{b}_dense_{i}")(x)
        outs.append(x)
    return keras.Model(inp, keras.layers.Concatenate()(outs), name="wide")


def plan():
    rules = [ff.freeze("**")]
    rules += [ff.train(f"block_{b}_*/kernel") for b in range(0, 40, 5)]
    rules += [ff.freeze(f"re:block_{b}_dense_\\d*7/.*") for b in range(0, 40, 10)]
    rules += [ff.train(f"block_{b}_dense_3/kernel[:2, ::2]") for b in range(40, 44)]
    rules += [ff.train("**/bias", where=lambda w: w == 0)]
    rules += [ff.freeze(keras.layers.Dense, mask=np.array([True, False, False, False]))]
    rules += [ff.train("block_49_dense_99/**")]
    assert len(rules) == 20
    return ff.Plan(rules)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true", help="print the top functions of one more Freezer")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = build_model()
    build_s = time.perf_counter() - t0
    assert len(model.weights) == 2 * N_LAYERS
    p = plan()
    times, cpu = [], []
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        frz = ff.Freezer(model, p)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    print(f"model with {len(model.weights):,} variables built in {build_s:.2f} s")
    print(
        f"Freezer (resolve 20 rules + set flags + fingerprint): median {med:.3f} s "
        f"(min {min(times):.3f}, max {max(times):.3f}) over 5 runs = {med / build_s:.1%} of the build"
    )
    print(f"  CPU time of this process: median {statistics.median(cpu):.3f} s (min {min(cpu):.3f}, max {max(cpu):.3f})")
    print(f"trainable variables: {len(frz.trainable_variables):,}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        ff.Freezer(model, p)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"finefreeze|numpy\(|read_variable_op", 25)


if __name__ == "__main__":
    main()
