"""Write the files of finefreeze 0.x that later releases must keep loading.

Run once with the release that is to be preserved (TensorFlow backend, one
thread, from the repository root)::

    KERAS_BACKEND=tensorflow python tests/data/release-0.x/make_files.py

It trains a small model under a plan whose layout holds every per-variable
kind (a variable frozen whole, ``restore``, ``compact``, a per-element
``lr_scale``, a trainable variable), stops in the middle of training and
writes:

- ``mid_training.keras``: the model compiled with a ``FreezingOptimizer``
  (Adam), saved after two epochs (layout version 2, key ``strategy``);
- ``resumed.npz``: every weight and optimizer variable after two further
  epochs of the same run, the values a loaded file must reproduce bit for bit;
- ``data.npz``: the training data of both halves;
- ``delta.safetensors`` with ``base.weights.h5``: the delta of the run at the
  save point and the base it applies to;
- ``plan.json`` and ``plan.toml``: the plan;
- ``board/``: the FreezeBoard log of the first two epochs;
- ``MANIFEST.json``: versions and what each file is.

``tests/test_release_files.py`` loads them.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402

HERE = pathlib.Path(__file__).parent


def build_model() -> keras.Model:
    """The functional model of the files: two hidden Dense layers and a head."""
    keras.utils.set_random_seed(7)
    x = keras.Input((12,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="enc")(x)
    h = keras.layers.Dense(16, activation="tanh", name="mid")(h)
    y = keras.layers.Dense(3, name="head")(h)
    return keras.Model(x, y, name="net")


def plan() -> ff.Plan:
    """Every kind: enc frozen whole, mid/kernel restore, head/kernel compact with per-element lr_scale."""
    return ff.Plan(
        [
            ff.freeze("**"),
            ff.train("**/mid/kernel[:, :8]"),  # half the columns: restore
            ff.train("**/mid/bias"),
            ff.train("**/head/kernel[0, :1]"),  # 2 of 48 elements with the next rule: compact
            ff.train("**/head/kernel[1, :1]", lr_scale=0.5),  # a per-element scale
            ff.train("**/head/bias"),
        ]
    )


def data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(128, 12)).astype("float32")
    y = rng.normal(size=(128, 3)).astype("float32")
    return x, y


def state(model) -> dict[str, np.ndarray]:
    """Every weight and optimizer variable by a stable key."""
    out = {f"weight:{i}:{v.path}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)}
    saved = [v for v in model.optimizer.variables if not v.name.startswith("grad_norm_")]  # FreezeBoard's, unsaved
    for i, v in enumerate(saved):  # names, not paths: a loaded optimizer scopes them anew
        out[f"optimizer:{i}:{v.name}"] = np.asarray(keras.ops.convert_to_numpy(v))
    return out


def main() -> None:
    assert keras.backend.backend() == "tensorflow", "make the files on the TensorFlow backend"
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    x, y = data()
    model = build_model()
    model.save_weights(HERE / "base.weights.h5")
    frz = ff.Freezer(model, plan())
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    board = HERE / "board"
    shutil.rmtree(board, ignore_errors=True)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[ff.callbacks.FreezeBoard(board)])
    model.save(HERE / "mid_training.keras")
    frz.save_delta(HERE / "delta.safetensors")
    plan().save(HERE / "plan.json")
    plan().save(HERE / "plan.toml")
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    frz.verify()
    np.savez(HERE / "resumed.npz", **state(model))
    np.savez(HERE / "data.npz", x=x, y=y)
    layouts = {e.path: e.kind for e in frz._layout}
    (HERE / "MANIFEST.json").write_text(
        json.dumps(
            {
                "finefreeze": ff.__version__,
                "keras": keras.__version__,
                "tensorflow": tf.__version__,
                "layout": layouts,
                "made_by": "tests/data/release-0.x/make_files.py",
                "files": {
                    "mid_training.keras": "model + FreezingOptimizer(Adam) after 2 epochs",
                    "resumed.npz": "weights and optimizer variables after 2 more epochs (shuffle=False, batch 32)",
                    "data.npz": "x, y of both halves",
                    "delta.safetensors": "delta at the save point, applies to base.weights.h5",
                    "base.weights.h5": "the weights before training",
                    "plan.json": "the plan",
                    "plan.toml": "the plan",
                    "board/": "FreezeBoard log of the first 2 epochs",
                },
            },
            indent=2,
        )
        + "\n"
    )
    print("wrote", sorted(p.name for p in HERE.iterdir()))


if __name__ == "__main__":
    main()
