"""The public features end to end on the Keras backend in force (run by tests/test_backends.py).

    KERAS_BACKEND=jax python tests/backend_smoke.py OUT_DIR

Prints one line per feature and ends with ``OK: <backend>``; exits non-zero on
the first failure. On a backend other than TensorFlow it also checks that
TensorFlow was never imported.
"""

import os
import sys

import keras
import numpy as np

import finefreeze as ff
from backend_utils import two_dense


def model(name="m"):
    return two_dense(name, 8, 16, names=("backbone", "head"))


def weights(m):
    return {v.path.split("/", 1)[-1]: np.array(keras.ops.convert_to_numpy(v), copy=True) for v in m.weights}


def main(out: str) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    plan = ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/backbone/kernel[:, :4]", lr_scale=0.5)])
    for strategy in ("restore", "compact"):
        m = model()
        before = weights(m)
        frz = ff.Freezer(m, plan, strategy=strategy)
        m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2, weight_decay=0.1, use_ema=True)), loss="mse")
        m.fit(x, y, epochs=2, batch_size=16, verbose=0)
        frz.verify()
        after = weights(m)
        frozen = frz.frozen_mask("m/backbone/kernel")
        assert np.array_equal(after["backbone/kernel"][frozen], before["backbone/kernel"][frozen])
        assert np.array_equal(after["backbone/bias"], before["backbone/bias"])
        assert not np.array_equal(after["head/kernel"], before["head/kernel"])
        print(f"fit, AdamW + EMA + lr_scale, {strategy}: frozen elements bit-identical")

    # a schedule that releases the backbone in the middle of fit
    m = model()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/backbone/**")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    mid = {}

    class Mid(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                mid.update(weights(self.model))

    sched = ff.callbacks.FreezeSchedule({1: ff.Plan([ff.freeze("**/head/**")])})
    m.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[Mid(), sched])
    end = weights(m)
    assert np.array_equal(mid["head/kernel"], end["head/kernel"])
    assert not np.array_equal(mid["backbone/kernel"], end["backbone/kernel"])
    frz.verify()
    print("FreezeSchedule inside fit: plan change exact")

    delta = os.path.join(out, "d.safetensors")
    frz.save_delta(delta)
    base = model()
    base.set_weights(m.get_weights())  # the frozen head as in m; the trained backbone wiped
    for v in base.get_layer("backbone").weights:
        v.assign(np.zeros(v.shape, "float32"))
    ff.load_delta(base, delta)
    assert all(np.array_equal(weights(base)[k], v) for k, v in weights(m).items())
    print("save_delta, load_delta: bit-identical")

    # the data scores; Reselect inside fit: the trained set changes, what was never trained stays exact
    for score in ("fisher", "gradient", "delta", "magnitude"):
        chosen = ff.select(model(), (x, y), budget=5, score=score, loss="mse", options={"verbose": 0})
        assert ff.Freezer(model(), chosen).report()["totals"]["trainable_elements"] == 5, score
    sm = model("s")
    start = weights(sm)
    frz = ff.Freezer(sm, ff.select(sm, (x, y), budget=20, score="fisher", loss="mse", options={"verbose": 0}))
    sm.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    never = {p: frz.frozen_mask("s/" + p) for p in start}

    class Never(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            for p in never:
                never[p] &= frz.frozen_mask("s/" + p)

    reselect = ff.callbacks.Reselect((x, y), every=2, fraction=0.5)
    sm.fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[Never(), reselect])
    frz.verify()
    assert len(reselect.swaps) == 2 and all(h["swapped"] for h in reselect.swaps)
    assert {h["trainable_elements"] for h in frz.history} == {20}
    end = weights(sm)
    assert all(np.array_equal(start[p][never[p]], end[p][never[p]]) for p in start)
    print("select: fisher, gradient, delta, magnitude; Reselect inside fit: exact")
    if keras.backend.backend() != "tensorflow":
        # (Keras itself imports TensorFlow, when installed, in set_random_seed and model.save)
        assert sys.modules.get("tensorflow") is None, "TensorFlow was imported"
        print("TensorFlow never imported")
    # save, load, Freezer.of, verify
    path = os.path.join(out, "m.keras")
    m.save(path)
    loaded = keras.models.load_model(path)
    again = ff.Freezer.of(loaded)
    again.verify(reference=m)
    loaded.fit(x, y, epochs=1, batch_size=16, verbose=0)
    again.verify()
    print("save, load_model, Freezer.of, verify: exact")
    print(f"OK: {keras.backend.backend()}")


if __name__ == "__main__":
    main(sys.argv[1])
