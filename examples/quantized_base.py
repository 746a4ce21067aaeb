"""Fine-tune a Keras int8-quantized model: a float delta of a few kernel columns beside the integers.

A pretrained text model is quantized by Keras (``model.quantize("int8")``:
its kernels become integers and scales, as QLoRA's base does). The plan
trains 25 % of the feed-forward and attention-output kernels' columns: what
trains of them is a float delta of those elements, added in the forward
pass, with the optimizer's state of its size; the integers and scales do not
move (``verify`` proves it, byte for byte). The plan names the float
kernels' shapes, so it is the one a float model would take. Two tasks'
deltas are served from one quantized base by ``DeltaSwitch``.
"""

import os
import tempfile

import keras
import numpy as np

import finefreeze as ff
from finefreeze._data.text_model import make_data, pretrained_text_model

folder = tempfile.mkdtemp()
pretrained_text_model(epochs=1, n=512).save(os.path.join(folder, "base.keras"))


def quantized_base():
    model = keras.models.load_model(os.path.join(folder, "base.keras"), compile=False)
    model.quantize("int8")
    return model


x, y = make_data(256, new_tokens=False)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
plans = {
    "feed-forward": [ff.freeze("**"), ff.train("ff_in/kernel", columns=0.25), ff.train("ff_out/kernel", columns=0.25)],
    "attention": [ff.freeze("**"), ff.train("attention/attention_output/kernel", columns=0.25)],
}
deltas, answers = {}, {}
for task, plan in plans.items():
    model = quantized_base()
    stored = {v.path: np.array(keras.ops.convert_to_numpy(v)) for v in model.weights}
    frz = ff.Freezer(model, plan)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=loss, metrics=["accuracy"])
    before = model.evaluate(x, y, verbose=0)[1]
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    after = model.evaluate(x, y, verbose=0)[1]
    frz.verify()  # every integer, scale and frozen float as it was, bit for bit
    assert all(np.array_equal(keras.ops.convert_to_numpy(v), stored[v.path]) for v in model.weights if v.path in stored)
    kernel = next(v for v in frz.report()["variables"] if v["quantized"] and v["state"] == "partial")
    deltas[task] = os.path.join(folder, f"{task}.safetensors")
    size = frz.save_delta(deltas[task])["bytes"]
    answers[task] = np.asarray(model.predict(x, verbose=0))
    print(
        f"{task:12s}: accuracy {before:.3f} -> {after:.3f}; {kernel['path']} {kernel['shape']} int8, "
        f"{kernel['trainable_elements']:,} elements trained as a float delta, Adam state "
        f"{kernel['optimizer_state_elements']:,}; delta file {size / 1024:.1f} KiB"
    )
    assert after >= before

served = quantized_base()
base_answer = np.asarray(served.predict(x, verbose=0))
switch = ff.DeltaSwitch(served, deltas)
for task in ("feed-forward", "attention", None):
    switch.use(task)
    assert np.array_equal(np.asarray(served.predict(x, verbose=0)), base_answer if task is None else answers[task])
switch.verify()
print("OK: a quantized base trained through float deltas, its integers bit-identical; two deltas served from it")
