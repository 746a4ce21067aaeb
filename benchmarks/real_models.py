"""Freezing on real architectures: step time of each way to freeze, and plan resolution time.

Per model, in one run: every variant is built and traced first, then timed in
interleaved rounds (A B C ... A B C ...); each round's step time is divided
by the full-training step time of the same round; the table gives the median
ratio (min-max over rounds). Custom ``tf.function`` step, Adam, batch 8 of
32x32 images (tokens of length 64 for the transformer), ``weights=None``.

Variants: full training; the head only by Keras' ``trainable=False`` on every
other layer, and by a layer-level plan; a fraction (1 %, 5 %, 20 %) of every
kernel by magnitude (plus the head) with ``restore`` and with ``compact``.
"Resolve" is the time to create the Freezer (resolution, flags, fingerprint).

    nice python benchmarks/real_models.py --model resnet50 --rounds 5 --steps 3
    nice python benchmarks/real_models.py --model efficientnetb0
    nice python benchmarks/real_models.py --model transformer   # keras_hub BertBackbone if importable
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402

FRACTIONS = (0.01, 0.05, 0.2)
tf.get_logger().setLevel("ERROR")  # one tf.function per variant is the point here


class Encoder(keras.layers.Layer):
    """A transformer encoder layer with sublayers built in ``build``, as KerasHub writes them."""

    def __init__(self, dim, heads, **kw):
        super().__init__(**kw)
        self.dim, self.heads = dim, heads

    def build(self, shape):
        d = shape[-1]
        self.att = keras.layers.MultiHeadAttention(self.heads, d // self.heads, name="self_attention_layer")
        self.att.build(shape, shape)
        self.n1 = keras.layers.LayerNormalization(name="self_attention_layer_norm")
        self.n1.build(shape)
        self.f1 = keras.layers.Dense(self.dim, activation="gelu", name="feedforward_intermediate_dense")
        self.f1.build(shape)
        self.f2 = keras.layers.Dense(d, name="feedforward_output_dense")
        self.f2.build((*shape[:-1], self.dim))
        self.n2 = keras.layers.LayerNormalization(name="feedforward_layer_norm")
        self.n2.build(shape)

    def call(self, x):
        x = self.n1(x + self.att(x, x))
        return self.n2(x + self.f2(self.f1(x)))


def transformer(length=64, vocab=5000, dim=256, layers=4):
    try:
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=vocab, num_layers=layers, num_heads=4, hidden_dim=dim, intermediate_dim=4 * dim
        )
        inputs = {
            "token_ids": keras.Input((length,), dtype="int32", name="token_ids"),
            "segment_ids": keras.Input((length,), dtype="int32", name="segment_ids"),
            "padding_mask": keras.Input((length,), dtype="int32", name="padding_mask"),
        }
        x = backbone(inputs)["pooled_output"]
        kind = "keras_hub BertBackbone"
    except ImportError:
        tokens = keras.Input((length,), dtype="int32", name="token_ids")
        inputs = tokens
        x = keras.layers.Embedding(vocab, dim, name="token_embedding")(tokens)
        for i in range(layers):
            x = Encoder(4 * dim, 4, name=f"transformer_layer_{i}")(x)
        x = keras.layers.Dense(dim, activation="tanh", name="pooled_dense")(x[:, 0])
        kind = "KerasHub-style backbone (keras_hub not installed)"
    out = keras.layers.Dense(10, name="predictions")(x)
    return keras.Model(inputs, out), kind


def build(name):
    if name == "transformer":
        model, kind = transformer()
        rng = np.random.default_rng(0)
        tok = rng.integers(0, 5000, (8, 64)).astype("int32")
        x = (
            tok
            if not isinstance(model.input, dict)
            else {"token_ids": tok, "segment_ids": 0 * tok, "padding_mask": 1 + 0 * tok}
        )
        return model, kind, x
    ctor = {
        "resnet50": keras.applications.ResNet50,
        "efficientnetb0": keras.applications.EfficientNetB0,
        "densenet121": keras.applications.DenseNet121,
    }[name]
    model = ctor(input_shape=(32, 32, 3), weights=None, classes=10)
    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype("float32")
    return model, name, x


def top(frac):
    def where(w):
        a = np.abs(w)
        return a >= np.quantile(a, 1 - frac)

    where.__name__ = f"top_{frac:g}"
    return where


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["resnet50", "efficientnetb0", "densenet121", "transformer"], default="resnet50")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    keras.utils.set_random_seed(0)
    model, kind, x = build(a.model)
    y = np.zeros((8, 10), "float32")
    loss_fn = keras.losses.MeanSquaredError()
    head = ["predictions/**"]

    def stepper(variables, opt):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        step()  # trace and warm up now, under the flags in force (BatchNorm modes are traced in)
        step()
        return step

    variants, resolve_s = {}, {}
    variants["full training"] = stepper(list(model.trainable_variables), keras.optimizers.Adam(1e-4))
    for layer in model.layers:  # Keras' way: trainable=False on all but the head
        layer.trainable = layer.name == "predictions"
    variants["head only: Keras trainable=False"] = stepper(list(model.trainable_variables), keras.optimizers.Adam(1e-4))
    for layer in model.layers:
        layer.trainable = True
    plans = {"head only: layer-level plan": (ff.Plan([ff.freeze("**"), *map(ff.train, head)]), "auto")}
    for frac in FRACTIONS:
        rules = [ff.freeze("**"), ff.train("**/kernel", where=top(frac)), *map(ff.train, head)]
        for strategy in ("restore", "compact"):
            plans[f"{frac:.0%} of kernels: {strategy}"] = (ff.Plan(rules), strategy)
    for name, (plan, strategy) in plans.items():
        t0 = time.perf_counter()
        frz = ff.Freezer(model, plan, strategy=strategy)
        resolve_s[name] = time.perf_counter() - t0
        variants[name] = stepper(frz.trainable_variables, frz.wrap(keras.optimizers.Adam(1e-4)))
    ratios = {k: [] for k in variants}
    full_ms = []
    for _ in range(a.rounds):
        got = {}
        for name, step in variants.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            got[name] = (time.perf_counter() - t0) / a.steps
        full_ms.append(1000 * got["full training"])
        for k, v in got.items():
            ratios[k].append(v / got["full training"])
    print(
        f"## {kind}: {sum(int(np.prod(v.shape)) for v in model.weights):,} weights, {len(model.weights)} variables, "
        f"full step {statistics.median(full_ms):.0f} ms\n"
    )
    print("| variant | step time vs full | resolve (s) |\n| --- | --- | --- |")
    for k, r in ratios.items():
        res = f"{resolve_s[k]:.2f}" if k in resolve_s else "–"
        print(f"| {k} | {statistics.median(r):.2f} ({min(r):.2f}–{max(r):.2f}) | {res} |")


if __name__ == "__main__":
    main()
