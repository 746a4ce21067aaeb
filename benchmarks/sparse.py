"""Sparse fine-tuning on real data: which 1 % (or 0.1 %) of the weights to train.

Base: the bundled digits MLP (64 -> 1024 -> 1024 -> 32, 1,148,960 parameters),
pretrained on scikit-learn's digits 0-4 (``benchmarks/pretrain_digits.py``).
Target: digits 5-9 turned a quarter turn, 50 labelled images per class, the
other 646 for testing; a new 5-class head. Every variant trains the head;
they differ in what else of the base trains. For each seed (the target split,
the head's initial weights, the random score) the variants run one after the
other, so they are interleaved over seeds. Same optimizer (Adam), learning
rate, epochs and batches for all.

Columns: trained values besides the head; target accuracy (mean ± sd over
seeds); optimizer state in bytes (every optimizer variable, including
finefreeze's index vectors); delta bytes (a safetensors file of what
training changed: ``Freezer.save_delta``, or every trained tensor for full
fine-tuning and LoRA) and the bytes of its tensors alone (values and
indices; ``save_delta`` also writes the plan, element masks included, as
JSON metadata); median step time (ms, the median per run after the
first epoch, then the median and min-max over seeds); seconds spent choosing.

    python benchmarks/sparse.py [--seeds 5] [--epochs 50] [--plot docs/select.png] [--only "LoRA" "1.0% fisher"]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import finefreeze as ff  # noqa: E402
from finefreeze._data.digits import pretrained_digits_model, target_task  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
BASE_LAYERS = ("dense_1", "dense_2", "bottleneck")
SCORES = [
    ("fisher", {}),
    ("gradient", {}),
    ("magnitude", {}),
    ("magnitude", {"largest": False}),
    ("delta", {}),
    ("random", {}),
]


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch > 0:
            self.times.append(time.perf_counter() - self.t)


def nbytes(variables) -> int:
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables))


def payload(path) -> int:
    """Bytes of the tensors in a safetensors file (values and indices, without the JSON header)."""
    with safe_open(path, framework="np") as f:
        return int(sum(f.get_tensor(k).nbytes for k in f.keys()))


def file_bytes(tensors: dict) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "delta.safetensors")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
        return os.path.getsize(path), payload(path)


def fit(model, optimizer, data, args, callbacks=()):
    (x, y), (xt, yt) = data
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    timer = StepTimer()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0, callbacks=[timer, *callbacks])
    acc = float(model.evaluate(xt, yt, verbose=0)[1])
    step = 1000 * statistics.median(timer.times) if timer.times else float("nan")
    return acc, step, nbytes(model.optimizer.variables)


def run_plain(kind, rank, seed, data, args):
    model = pretrained_digits_model(seed=seed)
    if kind == "lora":
        for name in BASE_LAYERS:
            layer = model.get_layer(name)
            layer.enable_lora(rank)
            layer.bias.trainable = False  # LoRA trains the low-rank factors only
    trained = [v for v in model.trainable_variables if not v.path.startswith("head/")]
    acc, step, opt = fit(model, keras.optimizers.Adam(args.lr), data, args)
    delta, tensors = file_bytes({v.path: v.numpy() for v in model.trainable_variables})
    n = int(sum(np.prod(v.shape) for v in trained))
    return dict(trained=n, acc=acc, step_ms=step, opt_bytes=opt, delta_bytes=delta, tensor_bytes=tensors, choose_s=0.0)


def run_sparse(score, options, budget, seed, data, args, reselect=False):
    model = pretrained_digits_model(seed=seed)
    t = time.perf_counter()
    if score is None:
        plan = ff.Plan([ff.freeze("**"), ff.train("head/**")])
    else:
        kwargs = dict(options)  # structure= is an argument of select, largest= one of its options
        knobs = {"seed": seed, "verbose": 0, "epochs": args.delta_epochs, "optimizer": keras.optimizers.Adam(args.lr)}
        if "largest" in kwargs:
            knobs["largest"] = kwargs.pop("largest")
        plan = ff.select(
            model, data[0], budget=budget, score=score, include="head/**", loss=LOSS, **kwargs, options=knobs
        )
    choose = time.perf_counter() - t
    frz = ff.Freezer(model, plan, gradients="sliced" if "structure" in options else "dense")  # slices: their own cost
    callbacks = [ff.callbacks.Reselect(data[0], every=args.reselect_every, fraction=0.1, batches=4)] if reselect else []
    acc, step, opt = fit(model, frz.wrap(keras.optimizers.Adam(args.lr)), data, args, callbacks)
    frz.verify()
    trained = frz.report()["totals"]["trainable_elements"] - 32 * 5 - 5
    with tempfile.TemporaryDirectory() as d:
        delta = frz.save_delta(os.path.join(d, "delta.safetensors"))["bytes"]
        tensors = payload(os.path.join(d, "delta.safetensors"))
    out = dict(
        trained=trained, acc=acc, step_ms=step, opt_bytes=opt, delta_bytes=delta, tensor_bytes=tensors, choose_s=choose
    )
    return out, frz


def run_lora_sparse(rank, budget, seed, data, args):
    """LoRA of ``rank`` on the base layers plus the fisher-chosen base elements that fill ``budget`` up."""
    model = pretrained_digits_model(seed=seed)
    for name in BASE_LAYERS:
        layer = model.get_layer(name)
        layer.enable_lora(rank)
        layer.bias.trainable = False  # as LoRA alone: the biases stay as they are
    base = sum(int(np.prod(model.get_layer(n)._kernel.shape)) for n in BASE_LAYERS)
    adapters = sum(int(np.prod(v.shape)) for v in model.weights if "lora_kernel" in v.path)
    k = int(np.floor(budget * (base + sum(int(np.prod(model.get_layer(n).bias.shape)) for n in BASE_LAYERS)) + 0.5))
    t = time.perf_counter()
    plan = ff.select(
        model, data[0], budget=k - adapters, score="fisher", include=["head/**", "**/lora_kernel_*"], loss=LOSS,
        options={"seed": seed, "verbose": 0},
    )  # fmt: skip
    choose = time.perf_counter() - t
    frz = ff.Freezer(model, plan)
    acc, step, opt = fit(model, frz.wrap(keras.optimizers.Adam(args.lr)), data, args)
    frz.verify()
    trained = frz.report()["totals"]["trainable_elements"] - 32 * 5 - 5
    with tempfile.TemporaryDirectory() as d:
        delta = frz.save_delta(os.path.join(d, "delta.safetensors"))["bytes"]
        tensors = payload(os.path.join(d, "delta.safetensors"))
    return dict(
        trained=trained, acc=acc, step_ms=step, opt_bytes=opt, delta_bytes=delta, tensor_bytes=tensors, choose_s=choose
    )


def variants(args):
    out = [("head only", lambda s, d: run_sparse(None, {}, None, s, d, args)[0])]
    out.append(("full fine-tuning", lambda s, d: run_plain("full", 0, s, d, args)))
    for r in args.lora_ranks:
        out.append((f"LoRA rank {r}", lambda s, d, r=r: run_plain("lora", r, s, d, args)))
    for budget in args.budgets:
        for score, opts in SCORES:
            name = score + (" (smallest)" if opts.get("largest") is False else "")
            out.append(
                (f"{budget:.1%} {name}", lambda s, d, sc=score, o=opts, b=budget: run_sparse(sc, o, b, s, d, args)[0])
            )
    b0 = args.budgets[0]
    for structure in ("rows", "columns"):  # whole slices (S2FT-like): a sliced kernel trains at the slices' cost
        out.append(
            (
                f"{b0:.1%} fisher, whole {structure}",
                lambda s, d, st=structure: run_sparse("fisher", {"structure": st}, b0, s, d, args)[0],
            )
        )
    out.append((f"{b0:.1%} fisher + Reselect", lambda s, d: run_sparse("fisher", {}, b0, s, d, args, reselect=True)[0]))
    r = min(args.lora_ranks)
    out.append(
        (f"LoRA rank {r} + fisher to {b0:.1%}", lambda s, d: run_lora_sparse(r, b0, s, d, args))
    )  # low rank plus sparse (RoSA): the adapters and the base elements share one budget
    if args.only:  # head only and full fine-tuning always run: the gain is measured between them
        keep = lambda name: name in ("head only", "full fine-tuning") or any(o in name for o in args.only)  # noqa: E731
        out = [(name, fn) for name, fn in out if keep(name)]
    return out


def fmt_bytes(n):
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.001])
    p.add_argument("--lora-ranks", type=int, nargs="+", default=[3, 1])
    p.add_argument("--delta-epochs", type=int, default=3, help="full fine-tuning epochs behind the delta score")
    p.add_argument("--reselect-every", type=int, default=80, help="steps between reselections")
    p.add_argument("--plot", default=None, help="draw the 1 %% fisher plan of seed 0 to this image")
    p.add_argument("--json", default=None, help="write every run's numbers here")
    p.add_argument("--only", nargs="+", default=None, help="run the variants whose names contain one of these")
    args = p.parse_args()
    runs = variants(args)
    results = {name: [] for name, _ in runs}
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        data = target_task(seed)
        for name, fn in runs:
            results[name].append(fn(seed, data))
        print(f"seed {seed} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    elapsed = time.perf_counter() - t0
    head = statistics.mean(r["acc"] for r in results["head only"])
    full = statistics.mean(r["acc"] for r in results["full fine-tuning"])
    print(f"\n{args.seeds} seeds, {args.epochs} epochs, Adam({args.lr}), batch {args.batch_size}; {elapsed:.0f} s\n")
    print(
        "| variant | trained values besides the head | target accuracy | share of full's gain | optimizer state | delta file | its tensors | step (ms) | choosing (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, rs in results.items():
        accs = [r["acc"] for r in rs]
        steps = [r["step_ms"] for r in rs]
        gain = (statistics.mean(accs) - head) / (full - head) if full != head else float("nan")
        print(
            f"| {name} | {rs[0]['trained']:,} | {statistics.mean(accs):.3f} ± {statistics.stdev(accs) if len(accs) > 1 else 0:.3f} "
            f"| {gain:.0%} | {fmt_bytes(statistics.median(r['opt_bytes'] for r in rs))} "
            f"| {fmt_bytes(statistics.median(r['delta_bytes'] for r in rs))} "
            f"| {fmt_bytes(statistics.median(r['tensor_bytes'] for r in rs))} "
            f"| {statistics.median(steps):.2f} ({min(steps):.2f}–{max(steps):.2f}) "
            f"| {statistics.median(r['choose_s'] for r in rs):.1f} |"
        )
    if args.plot:
        model = pretrained_digits_model(seed=0)
        plan = ff.select(
            model, target_task(0)[0], budget=args.budgets[0], include="head/**", loss=LOSS, options={"verbose": 0}
        )
        ff.Freezer(model, plan).plot(
            args.plot, title=f"{args.budgets[0]:.0%} of the base chosen by fisher, plus the head (seed 0)"
        )


if __name__ == "__main__":
    main()
