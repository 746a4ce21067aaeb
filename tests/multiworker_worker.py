"""One worker of the MultiWorkerMirroredStrategy test (started by tests/test_distribute.py).

Usage: python multiworker_worker.py OUT.json   (with TF_CONFIG set by the test)

Trains a few steps of a custom loop (``strategy.run`` + ``apply_gradients``)
under a partial-element plan, checks that frozen elements are bit-identical
and writes what it saw to OUT.json. (Keras 3.15's ``fit`` fails under
MultiWorkerMirroredStrategy with a plain optimizer too: its first-batch
``strategy.reduce`` of an ``(x, y)`` tuple and its per-replica log reduction
both raise; see docs/distribute.md.)
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(out_path):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import finefreeze as ff

    global_batch = 16
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(3, name="b")], name="net"
        )
        plan = ff.Plan([ff.freeze("**/a/kernel[::2]"), ff.freeze("**/b/bias"), ff.train("**/b/bias[0]")])
        frz = ff.Freezer(model, plan, strategy=os.environ.get("FF_STRATEGY", "restore"))
        opt = frz.wrap(keras.optimizers.AdamW(0.05, weight_decay=0.1))
        opt.build(frz.trainable_variables)
    before = {v.path: v.numpy().copy() for v in model.weights}
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")
    ds = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))

    @tf.function
    def train_step(xb, yb):
        def step(xs, ys):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(ys, model(xs, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, frz.trainable_variables)
            opt.apply_gradients(zip(grads, frz.trainable_variables))

        strategy.run(step, args=(xb, yb))

    for _ in range(2):
        for xb, yb in ds:
            train_step(xb, yb)
    frz.verify()
    after = {v.path: v.numpy() for v in model.weights}
    frozen_ok = all(np.array_equal(before[p][frz.frozen_mask(p)], after[p][frz.frozen_mask(p)]) for p in before)
    trained = not np.array_equal(before["net/a/kernel"][1::2], after["net/a/kernel"][1::2])
    digest = hashlib.sha256(b"".join(after[p].tobytes() for p in sorted(after))).hexdigest()
    report = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "frozen_ok": bool(frozen_ok),
        "trained": bool(trained),
        "weights_sha256": digest,
        # the Freezer's fingerprint of the frozen elements (block hashes), after training
        "fingerprint": hashlib.sha256(b"".join(e.hashes.tobytes() for e in frz._fingerprint.entries)).hexdigest(),
        "iterations": int(opt.iterations.numpy()),
        "totals": frz.report()["totals"],
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":
    main(sys.argv[1])
