"""Every selector form, fit, verify, summary and report on the Keras backend in force, TensorFlow never imported.

    KERAS_BACKEND=jax python tests/backend_no_tensorflow.py

Run by tests/test_backends.py where TensorFlow is installed: nothing in
finefreeze may import it off the TensorFlow backend (seconds and hundreds of
MB). Prints ``OK: <backend>`` and exits 0, or names what imported it.
"""

import sys

import keras
import numpy as np

import finefreeze as ff


def main() -> None:
    assert keras.backend.backend() != "tensorflow", "run this on JAX or PyTorch"
    # no keras.utils.set_random_seed: it imports TensorFlow itself where it is installed
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, name="body")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    out = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(inp, out, name="m")
    body, head = model.get_layer("body"), model.get_layer("head")
    plan = ff.Plan(
        [
            ff.freeze("**"),  # a glob
            ff.train("re:.*head/bias"),  # a regular expression
            ff.train(keras.layers.LayerNormalization),  # a layer class
            ff.train(body),  # a layer instance
            ff.freeze(body.kernel, mask=np.eye(6, 8, dtype=bool)),  # a variable, with a mask
            ff.train(head.kernel, indices=[(0, 0), (1, 2)]),  # with indices
            ff.train(lambda path, v: path.endswith("body/bias"), where=lambda value: value >= 0),  # a callable, where=
            ff.train("**/head/kernel[2:, :1]"),  # an index suffix
        ]
    )
    frz = ff.Freezer(model, plan)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(32, 6)), rng.normal(size=(32, 3)), epochs=2, verbose=0)
    frz.verify()
    assert "body/kernel" in frz.summary()
    assert frz.report()["totals"]["trainable_elements"] > 0
    leaked = sorted(m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow."))
    assert not leaked, f"TensorFlow was imported: {leaked[:5]}"
    print(f"OK: {keras.backend.backend()}")


if __name__ == "__main__":
    main()
