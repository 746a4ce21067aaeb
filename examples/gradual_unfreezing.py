"""Gradual unfreezing of a pretrained backbone, top block first, each group with its own lr_scale.

Epoch 0 trains the head; epoch 1 adds block_3 (lr_scale 0.5); epoch 2 adds
block_2 (0.25); epoch 3 adds block_1 (0.1). Run: python examples/gradual_unfreezing.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402

keras.utils.set_random_seed(0)
inp = x = keras.Input((16,))
for i in range(1, 4):
    x = keras.layers.Dense(16, activation="gelu", name=f"block_{i}")(x)
model = keras.Model(inp, keras.layers.Dense(3, name="head")(x), name="net")

frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("head/**")]))
model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss="mse")
unfreeze = ff.callbacks.GradualUnfreezing(
    [ff.train("block_3/**", lr_scale=0.5), ff.train("block_2/**", lr_scale=0.25), ff.train("block_1/**", lr_scale=0.1)]
)
moved = []


class Watch(keras.callbacks.Callback):
    """Which layers' weights changed during each epoch (the proof, not the flags)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.before = [v.numpy().copy() for v in model.weights]

    def on_epoch_end(self, epoch, logs=None):
        changed = {v.path.split("/")[0] for v, b in zip(model.weights, self.before) if not np.array_equal(v.numpy(), b)}
        moved.append(sorted(changed))


x = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
y = np.random.default_rng(1).normal(size=(128, 3)).astype("float32")
model.fit(x, y, batch_size=32, epochs=4, verbose=0, validation_data=(x, y), callbacks=[unfreeze, Watch()])
for epoch, layers in enumerate(moved):
    print(f"epoch {epoch}: trained {', '.join(layers)}")
print(frz.summary(variables=False))
frz.verify()
assert moved == [
    ["head"],
    ["block_3", "head"],
    ["block_2", "block_3", "head"],
    ["block_1", "block_2", "block_3", "head"],
]
assert [h["trainable_elements"] for h in frz.history] == [51, 323, 595, 867]
print("OK: one more block per epoch, top first, each with its own learning-rate scale")
