"""Keep pruned weights at exactly zero while fine-tuning: freeze where=lambda w: w == 0.

Run: python examples/pruned_weights.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((10,)), keras.layers.Dense(32, activation="relu", name="d1"), keras.layers.Dense(1, name="d2")],
    name="net",
)
# magnitude pruning: zero the 70 % smallest weights of each kernel
for layer in model.layers:
    k = layer.kernel.numpy()
    k[np.abs(k) < np.quantile(np.abs(k), 0.7)] = 0.0
    layer.kernel.assign(k)
zeros_before = {layer.name: layer.kernel.numpy() == 0 for layer in model.layers}

plan = ff.Plan([ff.freeze("**/kernel", where=lambda w: w == 0)])  # evaluated once, when the plan resolves
frz = ff.Freezer(model, plan)
print(frz.summary())
model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2, weight_decay=0.05)), loss="mse")
x = np.random.default_rng(0).normal(size=(256, 10)).astype("float32")
y = x[:, :1] * 2 - x[:, 1:2]
loss0 = model.evaluate(x, y, verbose=0)
model.fit(x, y, batch_size=32, epochs=5, verbose=0)
loss1 = model.evaluate(x, y, verbose=0)
print(f"loss {loss0:.3f} -> {loss1:.3f}")
for layer in model.layers:
    k = layer.kernel.numpy()
    assert (k[zeros_before[layer.name]] == 0).all()
    print(f"{layer.name}: {int(zeros_before[layer.name].sum())} pruned weights still exactly 0")
frz.verify()
assert loss1 < loss0
print("OK: pruned weights stayed exactly zero while the rest trained")
