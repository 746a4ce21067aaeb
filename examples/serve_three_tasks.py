"""One base model in memory answers batches for three tasks, switching sparse deltas in place per batch.

Three fine-tunes of one pretrained base, each training a different small
part of it (new token rows and the head; 2 % of the feed-forward kernel's
elements chosen by Fisher score; one attention head's output columns), give
three small delta files. A ``DeltaSwitch`` holds them, sparse, next to the
one loaded base and puts each task's elements in before its batch; between
tasks the base's values go back bit for bit. Every answer equals what that
task's own fine-tuned model answers.
"""

import os
import tempfile

import keras
import numpy as np

import finefreeze as ff
from finefreeze._data.text_model import DEFAULT_PLAN, make_data, pretrained_text_model

folder = tempfile.mkdtemp()
pretrained_text_model(epochs=1, n=1024).save(os.path.join(folder, "base.keras"))  # the shared base, on disk


def base_model():
    return keras.models.load_model(os.path.join(folder, "base.keras"), compile=False)


x, y = make_data(512, new_tokens=True)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
plans = {  # the second plan: the 2 % of the base's elements with the highest Fisher score on the task
    "new-tokens": ff.Plan.from_dict(DEFAULT_PLAN),  # the new rows of the embedding and the head
    "fisher": ff.select(base_model(), (x, y), budget=0.02, score="fisher", loss=loss, options={"verbose": 0}),
    "one-head": ff.Plan([ff.freeze("**"), ff.train("**/attention/attention_output/kernel[1]")]),
}
tuned = {}
for task, plan in plans.items():  # three fine-tunes of the same base, as three teams would run them
    model = base_model()
    frz = ff.Freezer(model, plan)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(5e-3)), loss=loss)
    model.fit(x, y, epochs=2, batch_size=64, verbose=0)
    frz.save_delta(os.path.join(folder, f"{task}.safetensors"))
    tuned[task] = model
    size = os.path.getsize(os.path.join(folder, f"{task}.safetensors"))
    print(
        f"{task:10s}: {frz.report()['totals']['trainable_elements']:6,} elements trained, delta {size / 1024:.1f} KiB"
    )

served = base_model()  # the one model in memory
base = [np.array(w.numpy(), copy=True) for w in served.weights]
switch = ff.DeltaSwitch(served, {task: os.path.join(folder, f"{task}.safetensors") for task in plans})

requests = [("fisher", x[:8]), ("new-tokens", x[8:16]), ("one-head", x[16:24]), ("fisher", x[24:32]), (None, x[:8])]
for task, batch in requests:
    switch.use(task)  # in place: the active task's elements out, this task's in
    answer = np.asarray(served.predict(batch, verbose=0))
    want = tuned[task] if task is not None else base_model()
    assert np.array_equal(answer, np.asarray(want.predict(batch, verbose=0))), task
    print(f"batch for {task or 'the base'}: answered as its own model answers")

switch.use(None)
assert all(np.array_equal(w.numpy(), b) for w, b in zip(served.weights, base))
print("OK: three tasks served from one base by switching deltas in place; the base is back bit for bit")
