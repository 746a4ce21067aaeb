"""What a trained slice of a kernel costs: the weight gradient of the slice only, against the full step.

Model: an MLP of ``--depth`` Dense(``--width``, relu) layers and a
Dense(10) head, batch ``--batch``, Adam, Keras' own training step
(``train_on_batch``: ``tf.function`` on TensorFlow, ``jax.jit`` on JAX,
eager on PyTorch). Variants, each its own model and optimizer, built and
warmed up first, then timed in interleaved rounds (A B C ..., A B C ...):

- ``full``: plain Keras, everything trains;
- ``floor``: every kernel frozen, biases train (forward and backward with
  input gradients, no weight gradient at all);
- ``cols 10 %``, ``cols 1 %``, ``rows 10 %``: in every hidden kernel but the
  first, that share of output columns / input rows trains, the rest of the
  kernels frozen (``gradients="sliced"``: the slice's own weight gradient);
- ``cols 10 % dense``: the same plan with ``gradients="dense"`` (the whole
  weight gradient, then the strategy keeps the frozen part);
- ``elements 10 %``: 10 % of each such kernel's elements at random (no slice);
- ``elements 0.1 %``, ``0.3 %``, ``1 %``, ``3 %`` (``gradients="sliced"``: the sampled
  product, the weight gradient at those elements only) and ``elements 0.1 %
  dense``, ``0.3 % dense``, ``1 % dense`` (the whole weight gradient): where the
  sampled product stops paying (``gradients="auto"`` samples what these say pays);
- ``cols 10 % list`` (every tenth column, an index list), ``cols 25 %``,
  ``cols 50 %``, ``cols 50 % list`` (every other column) and
  ``cols 50 % dense``: where slicing stops paying
  (``gradients="auto"`` slices what these say pays).

``excess = (step - floor) / (full - floor)`` per round: 1.0 means the frozen
part cost as much as training it, 0.1 what training a tenth should cost.
Printed: the median over rounds (min-max), step / full step, the optimizer's
state as a share of plain Adam's, the frozen elements bit-identical
(``verify``), and above the table the rounding of the slice's gradient (one
batch's gradient of the trained elements against the dense path's, relative
to the largest).

    python benchmarks/slices.py [--rounds 7] [--steps 10] [--threads 1]
    python benchmarks/slices.py --model transformer   # 10 % of heads and of FFN channels
    python benchmarks/slices.py --model conv          # 10 % of output channels
    KERAS_BACKEND=jax python benchmarks/slices.py --model transformer --memory   # + the gradient's peak temp memory
    KERAS_BACKEND=jax python benchmarks/slices.py
    KERAS_BACKEND=jax python benchmarks/slices.py --width 8192 --depth 8 --batch 4096 --threads 0   # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cost import threads  # noqa: E402


def interleaved(variants: dict, x, y, rounds: int, steps: int) -> dict:
    """Seconds per step of each variant, per round, the variants timed by turns (A B C ..., A B C ...)."""
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for name, m in variants.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                m.train_on_batch(x, y)
            times[name].append((time.perf_counter() - t0) / steps)
    return times


@contextlib.contextmanager
def sampling(on: bool):
    """Inside, ``gradients="sliced"`` gives scattered elements the sampled product even where a block costs less."""
    from finefreeze._backends import costs

    saved = dict(costs.AUTO_SAMPLES)
    if on:
        costs.AUTO_SAMPLES.update(dict.fromkeys(saved, 1e9))
    try:
        yield
    finally:
        costs.AUTO_SAMPLES.update(saved)


def one_gradient(model, x, y, loss):
    """``(paths, gradients)`` of the model's trainable variables on one batch, on the backend in force."""
    import keras
    import numpy as np

    variables = list(model.trainable_variables)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss(y, model(x))
        grads = tape.gradient(value, variables)
    elif backend == "jax":
        import jax

        def pure(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss(y, model(x))

        grads = jax.grad(pure)([v.value for v in variables])
    else:
        for v in variables:
            v.value.grad = None
        loss(y, model(x)).backward()
        grads = [v.value.grad for v in variables]
    return [v.path for v in variables], [np.asarray(keras.ops.convert_to_numpy(g)) for g in grads]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=896)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated variants (full and floor always run)")
    ap.add_argument("--model", choices=["mlp", "transformer", "conv"], default="mlp")
    ap.add_argument("--memory", action="store_true", help="JAX: the compiled gradient's temporary memory per variant")
    a = ap.parse_args()
    if a.model != "mlp":
        return other_model(a)
    threads(a.threads)

    import keras
    import numpy as np

    import finefreeze as ff

    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.batch, a.width)).astype("float32")
    y = rng.integers(0, 10, a.batch).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    w = a.width
    hidden = [f"d{i}" for i in range(1, a.depth)]  # every hidden kernel but the first

    def model():
        keras.utils.set_random_seed(0)
        i = keras.Input((w,))
        h = i
        for k in range(a.depth):
            h = keras.layers.Dense(w, activation="relu", name=f"d{k}")(h)
        return keras.Model(i, keras.layers.Dense(10, name="head")(h), name="mlp")

    def sliced(index):
        return ff.Plan([ff.freeze("**/kernel"), *(ff.train(f"**/{n}/kernel{index}") for n in hidden)])

    def scattered(fraction):
        masks = [np.zeros(w * w, bool) for _ in hidden]
        for mask in masks:
            mask[rng.choice(w * w, max(1, int(fraction * w * w)), replace=False)] = True
        rules = [ff.train(f"**/{n}/kernel", mask=mask.reshape(w, w)) for n, mask in zip(hidden, masks)]
        return ff.Plan([ff.freeze("**/kernel"), *rules])

    elements = scattered(0.10)
    plans = {
        "full": None,
        "floor": (ff.Plan([ff.freeze("**/kernel")]), "dense"),
        "cols 10 %": (sliced(f"[:, :{w // 10}]"), "sliced"),
        "cols 10 % dense": (sliced(f"[:, :{w // 10}]"), "dense"),
        "cols 10 % restore": (sliced(f"[:, :{w // 10}]"), "sliced", "restore"),
        "cols 1 %": (sliced(f"[:, :{max(1, w // 100)}]"), "sliced"),
        "rows 10 %": (sliced(f"[:{w // 10}]"), "sliced"),
        "cols 10 % list": (sliced("[:, ::10]"), "sliced"),
        "cols 25 %": (sliced(f"[:, :{w // 4}]"), "sliced"),
        "cols 50 %": (sliced(f"[:, :{w // 2}]"), "sliced"),
        "cols 50 % list": (sliced("[:, ::2]"), "sliced"),
        "cols 50 % dense": (sliced(f"[:, :{w // 2}]"), "dense"),
        "elements 10 %": (elements, "sliced"),
    }
    for pct in (0.1, 0.3, 1, 3):
        few = scattered(pct / 100)
        plans[f"elements {pct} %"] = (few, "sampled")  # the sampled product, whatever a block would cost
        plans[f"elements {pct} % dense"] = (few, "dense")
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    plans = {k: v for k, v in plans.items() if k in ("full", "floor") or not only or k in only}
    variants, info = {}, {}
    for name, spec in plans.items():
        m = model()
        before = [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in m.weights]
        if spec is None:
            frz, opt = None, keras.optimizers.Adam(1e-3)
        else:
            with sampling(spec[1] == "sampled"):
                g = "sliced" if spec[1] == "sampled" else spec[1]
                frz = ff.Freezer(m, spec[0], gradients=g, strategy=spec[2] if len(spec) > 2 else "auto")
            opt = frz.wrap(keras.optimizers.Adam(1e-3))
        m.compile(optimizer=opt, loss=loss)
        m.train_on_batch(x, y)  # builds, traces, warms up
        m.train_on_batch(x, y)
        variants[name], info[name] = m, (frz, opt, before)
    times = interleaved(variants, x, y, a.rounds, a.steps)
    # rounding: the gradient of one batch, the slice's against the dense path's, on the trained elements
    gap = None
    if "cols 10 %" in plans:
        got = {}
        for g in ("sliced", "dense"):
            m = model()
            frz = ff.Freezer(m, plans["cols 10 %"][0], gradients=g)
            got[g] = one_gradient(m, x, y, loss)
        gap = max(
            float(np.abs(a - d)[~frz.frozen_mask(p)].max() / max(float(np.abs(d).max()), 1e-30))
            for p, a, d in zip(got["sliced"][0], got["sliced"][1], got["dense"][1])
        )
    full_state = 2 * sum(int(np.prod(v.shape)) for v in variants["full"].trainable_weights)
    print(
        f"## {keras.backend.backend()}: MLP {a.depth} x Dense({w}) + head, batch {a.batch}, Adam, "
        f"{a.threads or 'default'} thread(s); full step {1000 * statistics.median(times['full']):.1f} ms, "
        f"floor step {1000 * statistics.median(times['floor']):.1f} ms\n"
    )
    if gap is not None:
        print(f"Trained elements' gradient of one batch, cols 10 % against the dense path: {gap:.1e} of its largest.\n")
    print("| variant | excess | step / full | optimizer state / plain Adam's | frozen | gradient |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, ts in times.items():
        frz, opt, before = info[name]
        excess = [(t - f) / (u - f) for t, f, u in zip(ts, times["floor"], times["full"])]
        step = [t / u for t, u in zip(ts, times["full"])]
        state = sum(int(np.prod(v.shape)) for v in opt.variables) - 1
        kept = "—"
        if frz is not None:
            try:
                frz.verify()
                kept = "bit-identical"
            except ff.FrozenValueChanged:
                kept = "MOVED"
        ex = "—"
        if name not in ("full", "floor"):
            ex = f"{statistics.median(excess):.2f} ({min(excess):.2f}–{max(excess):.2f})"
        kinds = "—" if frz is None else "/".join(sorted({v["gradient"] for v in frz.report()["variables"]} - {None}))
        print(
            f"| {name} | {ex} | {statistics.median(step):.2f} ({min(step):.2f}–{max(step):.2f}) | "
            f"{100 * state / full_state:.1f} % | {kept} | {kinds} |"
        )


def other_model(a):
    """A transformer (10 % of heads and of FFN channels) or a conv net (10 % of output channels), sliced vs dense."""
    threads(a.threads)
    import keras
    import numpy as np

    import finefreeze as ff

    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if a.model == "transformer":
        d, heads, seq, blocks = 320, 10, 64, 3
        x = rng.normal(size=(a.batch // 12, seq, d)).astype("float32")

        def model():
            keras.utils.set_random_seed(0)
            i = keras.Input((seq, d))
            h = i
            for b in range(blocks):
                mha = keras.layers.MultiHeadAttention(heads, d // heads, name=f"mha{b}")
                h = keras.layers.LayerNormalization(name=f"ln{b}a")(h + mha(h, h))
                f = keras.layers.Dense(4 * d, activation="relu", name=f"ffn{b}a")(h)
                h = keras.layers.LayerNormalization(name=f"ln{b}b")(h + keras.layers.Dense(d, name=f"ffn{b}b")(f))
            h = keras.layers.GlobalAveragePooling1D()(h)
            return keras.Model(i, keras.layers.Dense(10, name="head")(h), name="transformer")

        one, ffn = 1, 4 * d // 10  # one head of ten; a tenth of the FFN channels
        rules = []
        for b in range(blocks):
            rules += [ff.train(f"**/mha{b}/{p}/kernel[:, :{one}]") for p in ("query", "key", "value")]
            rules += [ff.train(f"**/mha{b}/attention_output/kernel[:{one}]")]
            rules += [ff.train(f"**/ffn{b}a/kernel[:, :{ffn}]"), ff.train(f"**/ffn{b}b/kernel[:{ffn}]")]
        what = f"{blocks} blocks of MultiHeadAttention({heads} heads, d {d}) + FFN({4 * d}), {seq} tokens"
        trained = "10 % of heads and of FFN channels"
    else:
        ch, depth = 128, 4
        x = rng.normal(size=(a.batch // 6, 24, 24, 16)).astype("float32")

        def model():
            keras.utils.set_random_seed(0)
            i = keras.Input((24, 24, 16))
            h = i
            for k in range(depth):
                h = keras.layers.Conv2D(ch, 3, padding="same", activation="relu", name=f"c{k}")(h)
            h = keras.layers.GlobalAveragePooling2D()(h)
            return keras.Model(i, keras.layers.Dense(10, name="head")(h), name="conv")

        rules = [ff.train(f"**/c{k}/kernel[..., :{ch // 10}]") for k in range(1, depth)]
        what = f"{depth} x Conv2D({ch}, 3x3) on 24 x 24 x 16"
        trained = "10 % of output channels of every conv but the first"
    y = rng.integers(0, 10, len(x)).astype("int32")
    plans = {
        "full": None,
        "floor": (ff.Plan([ff.freeze("**/kernel")]), "dense"),
        "10 % sliced": (ff.Plan([ff.freeze("**/kernel"), *rules]), "sliced"),
        "10 % dense": (ff.Plan([ff.freeze("**/kernel"), *rules]), "dense"),
    }
    variants, info = {}, {}
    for name, spec in plans.items():
        m = model()
        frz = None if spec is None else ff.Freezer(m, spec[0], gradients=spec[1])
        opt = keras.optimizers.Adam(1e-3) if frz is None else frz.wrap(keras.optimizers.Adam(1e-3))
        m.compile(optimizer=opt, loss=loss)
        m.train_on_batch(x, y)
        m.train_on_batch(x, y)
        variants[name], info[name] = m, (frz, opt)
    times = interleaved(variants, x, y, a.rounds, a.steps)
    full_state = 2 * sum(int(np.prod(v.shape)) for v in variants["full"].trainable_weights)
    print(
        f"## {keras.backend.backend()}: {what}, batch {len(x)}, Adam, {a.threads or 'default'} thread(s); "
        f"{trained}; full step {1000 * statistics.median(times['full']):.1f} ms, "
        f"floor step {1000 * statistics.median(times['floor']):.1f} ms\n"
    )
    memory = a.memory and keras.backend.backend() == "jax"
    print(
        "| variant | excess | step / full | optimizer state / plain Adam's | frozen |" + (" gradient temp |" * memory)
    )
    print("| --- | --- | --- | --- | --- |" + (" --- |" * memory))
    for name, ts in times.items():
        frz, opt = info[name]
        excess = [(t - f) / (u - f) for t, f, u in zip(ts, times["floor"], times["full"])]
        step = [t / u for t, u in zip(ts, times["full"])]
        state = sum(int(np.prod(v.shape)) for v in opt.variables) - 1
        kept = "—"
        if frz is not None:
            frz.verify()
            kept = "bit-identical"
        ex = (
            "—"
            if name in ("full", "floor")
            else f"{statistics.median(excess):.2f} ({min(excess):.2f}–{max(excess):.2f})"
        )
        mem = f" {gradient_temp_mib(variants[name], x, y, loss):.1f} MiB |" if memory else ""
        print(
            f"| {name} | {ex} | {statistics.median(step):.2f} ({min(step):.2f}–{max(step):.2f}) | "
            f"{100 * state / full_state:.1f} % | {kept} |{mem}"
        )


def gradient_temp_mib(model, x, y, loss) -> float:
    """JAX: the temporary memory XLA's compiled gradient of the trainable variables needs (memory_analysis)."""
    import jax
    import keras

    variables = list(model.trainable_variables)
    others = [v for v in model.variables if all(v is not w for w in variables)]

    def pure(values):
        with keras.StatelessScope(state_mapping=list(zip(variables, values)) + [(v, v.value) for v in others]):
            return loss(y, model(x))

    compiled = jax.jit(jax.grad(pure)).lower([v.value for v in variables]).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


if __name__ == "__main__":
    main()
