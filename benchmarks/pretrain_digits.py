"""Pretrain the digits base on the source task and write the shipped weights.

Trains ``build_digits_model`` on digits 0-4 (upright) and writes the base's
weights as float16 to ``src/finefreeze/_data/digits_base.npz`` (the head is
not shipped: every fine-tune draws a new one).

    python benchmarks/pretrain_digits.py [--epochs 30]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from finefreeze._data.digits import WEIGHTS, build_digits_model, source_task  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--out", default=WEIGHTS)
    args = p.parse_args()
    x, y = source_task()
    model = build_digits_model(5, seed=0)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    n_val = len(y) // 5
    val, tr = order[:n_val], order[n_val:]
    model.fit(x[tr], y[tr], batch_size=32, epochs=args.epochs, validation_data=(x[val], y[val]), verbose=2)
    weights = {v.path: np.asarray(v.numpy(), "float16") for v in model.weights if not v.path.startswith("head/")}
    np.savez_compressed(args.out, **weights)
    print(f"wrote {args.out}: {os.path.getsize(args.out):,} bytes, {sum(w.size for w in weights.values()):,} values")


if __name__ == "__main__":
    main()
