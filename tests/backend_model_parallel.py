"""ModelParallel on 8 host devices with KerasHub's Gemma layout map: the sliced and sampled paths, nothing replicated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 KERAS_BACKEND=jax python tests/backend_model_parallel.py

A Gemma backbone with 8 query and 4 key/value heads, under its causal LM
(tied logits) and under a classifier of its mean-pooled output, on a (2, 4)
mesh of ``batch`` and ``model`` axes laid out by
``GemmaBackbone.get_layout_map``, trained under a plan with every path that
computes a part of a weight gradient: 2 % of the columns of the gating
kernels (a slice), one head in four of each query kernel, 1 % of the
elements of the key, value and output projections and of the last
feed-forward kernel, scattered (the sampled product), and the last 16 rows
of the table (their lookups' and tied logits' gradient). The same training
on one device is the reference: frozen elements bit-identical, trained ones
within ``rtol=1e-5, atol=1e-6`` (the sharded products sum in another
order). The test that runs this reads its stderr for XLA's "Involuntary
full rematerialization" (all of a tensor copied to every device).
"""

import keras
import keras_hub
import numpy as np

import finefreeze as ff

CONFIG = dict(
    vocabulary_size=256, num_layers=2, hidden_dim=128, intermediate_dim=256, num_query_heads=8,
    num_key_value_heads=4, head_dim=16,
)  # fmt: skip
BATCH, LENGTH = 8, 32
CLASSES = 8


def plan(backbone) -> list:
    rules = [ff.freeze("**"), ff.train("**/ffw_gating*/kernel", columns=0.02), ff.train("**/query/kernel", heads=0.25)]
    for v in backbone.weights:
        if any(f"/{name}/kernel" in v.path for name in ("key", "value", "attention_output", "ffw_linear")):
            mask = np.zeros(int(np.prod(v.shape)), bool)
            mask[::97] = True  # 1 %, on every axis's whole range: no block smaller than the kernel holds them
            rules.append(ff.train(v, mask=mask.reshape(v.shape)))
    return [*rules, ff.train("**/token_embedding/embeddings[-16:]")]


def model(head: str):
    """The causal LM (``"lm"``: tied logits) or a classifier of its mean-pooled output (``"pooled"``)."""
    backbone = keras_hub.models.GemmaBackbone(**CONFIG)
    if head == "lm":
        return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None), backbone
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")}
    pooled = keras.ops.mean(backbone(inputs), axis=1)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled)), backbone


def train(head: str, start: list, distribution) -> tuple[list, list, ff.Freezer]:
    """Two steps of SGD from the weights ``start`` under ``distribution`` (None: one device)."""
    keras.distribution.set_distribution(distribution)
    m, backbone = model(head)
    m.set_weights(start)
    weights = list(m.weights)  # the model's own (the Freezer adds stand-ins of trained elements)
    frz = ff.Freezer(m, plan(backbone), gradients="sliced")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss=loss)
    rng = np.random.default_rng(1)
    x = {
        "token_ids": rng.integers(0, 256, (2 * BATCH, LENGTH)).astype("int32"),
        "padding_mask": np.ones((2 * BATCH, LENGTH), "int32"),
    }
    y = rng.integers(0, 256, (2 * BATCH, LENGTH)) if head == "lm" else np.arange(2 * BATCH) % CLASSES
    m.fit(x, y.astype("int32"), batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    frz.verify()
    return [v.path for v in weights], [np.asarray(keras.ops.convert_to_numpy(v)) for v in weights], frz


def check(head: str, mesh) -> None:
    """Train ``head``'s model on one device and on ``mesh``: frozen bytes kept, trained values alike."""
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    start = model(head)[0].get_weights()
    _, one, _ = train(head, start, None)
    layouts = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    names, sharded, frz = train(
        head, start, keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    )
    paths = {v["path"]: v["gradient"] for v in frz.report()["variables"] if v["state"] == "partial"}
    for name, how in [("ffw_gating", "sliced"), ("attention/query", "sliced"), ("ffw_linear", "sampled")]:
        assert paths[f"decoder_block_1/{name}/kernel"] == how, (name, paths)
    assert paths["decoder_block_1/attention/value/kernel"] == "sampled", paths
    assert paths["token_embedding/embeddings"] == "sliced", paths
    moved = 0
    for path, s, o, w in zip(names, sharded, one, start):
        state = frz.variable_state(path)
        frozen = frz.frozen_mask(path) if state == "partial" else np.full(w.shape, state == "frozen")
        assert np.array_equal(s[frozen], w[frozen]) and np.array_equal(o[frozen], w[frozen]), path  # bytes
        np.testing.assert_allclose(s, o, rtol=1e-5, atol=1e-6, err_msg=path)
        moved += int((s != w).sum())
    assert moved > 0
    print(f"ModelParallel, Gemma's layout map, {head}: frozen exact, {moved:,} trained values as on one device")


def main() -> None:
    devices = keras.distribution.list_devices("cpu")
    assert len(devices) == 8, devices
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices)
    for head in ("lm", "pooled"):
        check(head, mesh)
    print("OK")


if __name__ == "__main__":
    main()
