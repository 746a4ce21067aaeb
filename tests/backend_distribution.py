"""Keras' JAX distribution API: DataParallel and ModelParallel with a partially frozen kernel.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 KERAS_BACKEND=jax python tests/backend_distribution.py

Run by tests/test_backends.py. Prints one line per check and ends with ``OK``.
"""

import sys

import keras
import numpy as np

import finefreeze as ff

PLAN = ff.Plan([ff.freeze("**/backbone/kernel[:, :8]"), ff.freeze("**/backbone/kernel[0]")])
# the same frozen set, and two step sizes inside the kernel: one lr_scale per element
SCALED = ff.Plan([*PLAN.rules, ff.train("**/backbone/kernel[1:, 12:]", lr_scale=0.5)])
X = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")


def train(strategy, plan=PLAN, gradients="dense"):
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="backbone"), keras.layers.Dense(2, name="head")], name="m"
    )
    before = np.array(keras.ops.convert_to_numpy(m.get_layer("backbone").kernel), copy=True)
    frz = ff.Freezer(m, plan, strategy=strategy, gradients=gradients)
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2, weight_decay=0.1)), loss="mse")
    m.fit(X, Y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    frz.verify()
    after = np.asarray(keras.ops.convert_to_numpy(m.get_layer("backbone").kernel))
    frozen = frz.frozen_mask("m/backbone/kernel")
    assert np.array_equal(after[frozen], before[frozen]), "frozen elements moved"
    return m, after, frz


def new_rows():
    """New rows of an embedding on their own gradient (gradients="sliced"): the table after two epochs."""
    keras.utils.set_random_seed(0)
    ids = np.random.default_rng(2).integers(0, 30, (64, 5)).astype("int32")
    ids[:, 0] = 25 + np.arange(64) % 5  # every batch holds new tokens
    m = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(30, 4, name="tok"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, name="head"),
        ],
        name="m",
    )
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/tok/**"), ff.train("**/tok/embeddings[25:]")]), gradients="sliced")
    assert "_finefreeze_sliced" in m.get_layer("tok").__dict__
    before = np.array(keras.ops.convert_to_numpy(m.get_layer("tok").embeddings), copy=True)
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(ids, Y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    frz.verify()
    after = np.asarray(keras.ops.convert_to_numpy(m.get_layer("tok").embeddings))
    assert np.array_equal(after[:25], before[:25]), "frozen rows moved"
    assert not np.array_equal(after[25:], before[25:]), "the new rows did not train"
    return after


def sampled(gradients="sliced"):
    """Scattered trained elements on the sampled product (or ``gradients="dense"``): the kernel after two epochs."""
    n = 256  # one trained element in every row and column: no block holds them
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(64, n)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    scattered = np.eye(n, dtype=bool)[rng.permutation(n)]
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((n,)), keras.layers.Dense(n, activation="tanh", name="d"), keras.layers.Dense(2, name="head")],
        name="m",
    )
    plan = ff.Plan([ff.freeze("**/d/kernel"), ff.train("**/d/kernel", mask=scattered)])
    frz = ff.Freezer(m, plan, gradients=gradients)
    kind = {v["path"]: v["gradient"] for v in frz.report()["variables"]}["m/d/kernel"]
    assert kind == ("sampled" if gradients == "sliced" else "dense"), kind
    before = np.array(keras.ops.convert_to_numpy(m.get_layer("d").kernel), copy=True)
    # SGD: Adam's update would hide a gradient's scale
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    m.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    frz.verify()
    after = np.asarray(keras.ops.convert_to_numpy(m.get_layer("d").kernel))
    assert np.array_equal(after[~scattered], before[~scattered]), "frozen elements moved"
    assert (after[scattered] != before[scattered]).all(), "a trained element did not move"
    return after


def main() -> None:
    devices = keras.distribution.list_devices("cpu")
    assert len(devices) == 2, devices
    for strategy in ("restore", "compact"):
        keras.distribution.set_distribution(None)
        _, single, _ = train(strategy)
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        _, data_parallel, _ = train(strategy)
        np.testing.assert_allclose(data_parallel, single, rtol=1e-5, atol=1e-6)
        print(f"DataParallel over 2 devices, {strategy}: frozen exact, trained as on one device")

    sliced = ff.Plan([ff.freeze("**/backbone/kernel"), ff.train("**/backbone/kernel[:, 12:]")])
    keras.distribution.set_distribution(None)
    _, single_sliced, _ = train("auto", sliced, gradients="sliced")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    m, data_parallel, _ = train("auto", sliced, gradients="sliced")
    assert "_finefreeze_sliced" in m.get_layer("backbone").__dict__  # the slice's own weight gradient
    np.testing.assert_allclose(data_parallel, single_sliced, rtol=1e-5, atol=1e-6)
    print("DataParallel over 2 devices, a sliced kernel: frozen exact, trained as on one device")

    keras.distribution.set_distribution(None)
    single_rows = new_rows()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    np.testing.assert_allclose(new_rows(), single_rows, rtol=1e-5, atol=1e-6)
    print("DataParallel over 2 devices, new embedding rows: frozen exact, trained as on one device")

    keras.distribution.set_distribution(None)
    single_dense = sampled("dense")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    np.testing.assert_allclose(sampled(), single_dense, rtol=1e-5, atol=1e-6)
    print("DataParallel over 2 devices, sampled elements: frozen exact, trained as the dense path on one device")

    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts[".*backbone.*kernel"] = (None, "model")
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch"))
    m, sharded, frz = train("restore")
    kernel = m.get_layer("backbone").kernel
    mask = next(v for v in m.optimizer.variables if v.path.endswith("backbone.kernel.frozen_mask"))
    assert tuple(kernel.value.sharding.spec) == (None, "model"), kernel.value.sharding
    assert mask.value.sharding.spec == kernel.value.sharding.spec, mask.value.sharding
    np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-6)
    print("ModelParallel: the kernel and its frozen mask sharded alike; frozen exact")
    for strategy in ("restore", "compact"):
        keras.distribution.set_distribution(None)
        _, single, _ = train(strategy, SCALED)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
        )
        m, sharded, frz = train(strategy, SCALED)
        kernel = m.get_layer("backbone").kernel
        scale = next(v for v in m.optimizer.variables if v.path.endswith("backbone.kernel.lr_scale"))
        if strategy == "restore":  # one scale per element of the kernel: sharded like it
            assert tuple(scale.shape) == tuple(kernel.shape), scale.shape
            assert scale.value.sharding.spec == kernel.value.sharding.spec, scale.value.sharding
        else:  # one scale per trainable element, beside compact's values: replicated like them
            assert tuple(scale.shape) == (int((~frz.frozen_mask("m/backbone/kernel")).sum()),)
        np.testing.assert_allclose(sharded, single, rtol=1e-5, atol=1e-6)
        print(f"ModelParallel, {strategy}, lr_scale per element: laid out like its values; frozen exact")
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
