"""Low rank plus sparse: LoRA adapters and a few chosen elements of the base kernels train together.

Keras' ``enable_lora`` switches each base kernel off; finefreeze keeps those
kernels in plans (frozen unless a rule trains them), so ``ff.select`` can
choose the elements of the base worth training on top of the adapters (the
RoSA recipe). Uses the bundled digits model, pretrained on digits 0-4,
fine-tuned on rotated 5-9. Run: python examples/lora_plus_sparse.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402
from finefreeze._data.digits import pretrained_digits_model, target_task  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model = pretrained_digits_model(seed=0)  # 64 -> 1024 -> 1024 -> 32, and a new 5-class head
(x, y), (xt, yt) = target_task(seed=0)
for name in ("dense_1", "dense_2", "bottleneck"):
    model.get_layer(name).enable_lora(1)  # Keras' own LoRA: the base kernel's trainable flag goes off

# the adapters and the head in full, and the 5,000 base elements with the largest Fisher score
plan = ff.select(model, (x, y), budget=5000, include=["**/lora_*", "head/**"], loss=LOSS, options={"verbose": 0})
frz = ff.Freezer(model, plan)
print(frz.summary(variables=False))
kernel = model.get_layer("dense_1")._kernel
before = keras.ops.convert_to_numpy(kernel).copy()
model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-3)), loss=LOSS, metrics=["accuracy"])
model.fit(x, y, batch_size=32, epochs=50, verbose=0)
acc = model.evaluate(xt, yt, verbose=0)[1]
print(f"rotated digits 5-9, accuracy on the 646 test images: {acc:.2f}")
frz.verify()  # every frozen element of every base kernel, to the bit
frozen = frz.frozen_mask(kernel.path)
after = keras.ops.convert_to_numpy(kernel)
assert np.array_equal(after[frozen], before[frozen])
assert 0 < int((~frozen).sum()) < frozen.size and not np.array_equal(after[~frozen], before[~frozen])
assert acc > 0.6
print("OK: adapters and chosen base elements trained, the rest of the base bit-identical")
