"""Transfer learning with finefreeze: the keras.io guide's steps, with plans, on MobileNetV2.

1. a backbone (keras.applications, here weights=None and 32x32 inputs so it runs
   anywhere; use weights="imagenet" for real) called inside a new model, the
   guide's `outputs = head(base(inputs, training=False))`;
2. freeze the backbone by its name (a nested model's name is a scope), train the head;
3. unfreeze the top two blocks (found by ff.blocks) at a low learning rate;
4. BatchNorm stays in inference mode with its statistics fixed: Plan(batchnorm="frozen")
   (Keras 3 runs an unfrozen BatchNormalization in training mode even under
   training=False, so the guide's advice needs the option);
5. Keras' own `base.trainable = True` is honoured, and said.
Run: python examples/transfer_learning.py
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402

keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.uniform(0, 255, (64, 32, 32, 3)).astype("float32")
y = (x[..., 0].mean(axis=(1, 2)) > x[..., 2].mean(axis=(1, 2))).astype("float32")[:, None]  # red or blue?

# 1. the guide's model: a backbone called inside a new model
base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
inputs = keras.Input((32, 32, 3))
h = keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)
h = base(h, training=False)
h = keras.layers.GlobalAveragePooling2D()(h)
h = keras.layers.Dropout(0.2)(h)
outputs = keras.layers.Dense(1, name="head")(h)
model = keras.Model(inputs, outputs, name="classifier")

# 2. freeze the backbone by name and train the head
scope = f"{base.name}/**"  # "mobilenetv2_0.35_32/**": the nested model's name is a scope
frz = ff.Freezer(model, ff.Plan([ff.freeze(scope)]))
print(frz.summary())
model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-3)), loss=keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=2, verbose=0)
frz.verify()  # every backbone weight and BatchNorm statistic is bit-identical

# 3. unfreeze the top two blocks, at a low learning rate
top = ff.blocks(base)[-2:]
print("blocks:", ff.blocks(base), "-> unfreezing", [b.name for b in top])
stats_before = {v.path: v.numpy().copy() for v in base.non_trainable_weights}
frozen_before = base.get_layer("block_1_expand").kernel.numpy().copy()
top_before = base.get_layer("block_16_project").kernel.numpy().copy()
frz.update(ff.Plan([ff.freeze(scope), ff.train(top)], batchnorm="frozen"))
model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-5)), loss=keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
frz.verify()
print(frz.summary(detail=False))

# 4. what moved and what did not
assert np.array_equal(base.get_layer("block_1_expand").kernel.numpy(), frozen_before)
assert not np.array_equal(base.get_layer("block_16_project").kernel.numpy(), top_before)
assert all(np.array_equal(v.numpy(), stats_before[v.path]) for v in base.non_trainable_weights)

# 5. the guide's own switch still means what it says, both ways
for switch in (False, True):
    base.trainable = switch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = frz.wrap(keras.optimizers.Adam(1e-5))
    ours = [w for w in caught if issubclass(w.category, ff.FreezeWarning)]  # not numpy's or Keras' own
    print("warning:", ours[0].message)
    assert frz.plan.rules[-1] == (ff.train(scope) if switch else ff.freeze(scope))
assert len(frz.trainable_variables) == len(model.trainable_weights) == len(base.trainable_weights) + 2
print(
    f"OK: backbone frozen by name, top {len(top)} blocks fine-tuned, BatchNorm statistics unchanged, base.trainable honoured"
)
