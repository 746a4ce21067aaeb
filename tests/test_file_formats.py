"""One format per file kind: a model file's saved layout and a checkpoint's freeze record are format 1.

Each test writes a real file with finefreeze, then edits its format field
(or takes out what the format holds) and checks that reading it is refused
with an error that names the file, the format found, the one this version
reads and how to save it again, and that nothing was loaded. Delta files:
``tests/test_delta_integrity.py``.
"""

import json
import zipfile

import h5py
import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of

X = np.random.default_rng(0).normal(size=(24, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(24, 3)).astype("float32")
START = ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/block/kernel[:3]")])
LATER = START.train("**/block/bias")  # a plan change: the bias trains from then on
KEY = "optimizer/vars/finefreeze_checkpoint"
#: Keras loads the inner optimizer on its own as well, and skips it when its size differs from the file's
INNER_SKIPPED = pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer 'adam")


def layers():
    keras.utils.set_random_seed(0)
    return [keras.Input((6,)), keras.layers.Dense(5, name="block"), keras.layers.Dense(3, name="head")]


def build():
    model = keras.Sequential(layers(), name="net")
    frz = ff.Freezer(model, START)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.02)), loss="mse")
    return model, frz


def values(variables) -> list[np.ndarray]:
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


# -- the layout saved in a model file's optimizer config ------------------------------------------------------


def saved_model(tmp_path):
    model, _ = build()
    model.fit(X, Y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    return model, tmp_path / "m.keras"


def with_layout(path, out, change):
    """A copy of the model file ``path`` at ``out`` whose saved layout ``change`` edited in place."""
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    config = json.loads(members["config.json"])
    change(config["compile_config"]["optimizer"]["config"]["layout"])
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out


def test_a_model_file_saves_its_layout_as_format_1_and_loads_it(tmp_path):
    model, path = saved_model(tmp_path)
    layout = json.loads(zipfile.ZipFile(path).read("config.json"))["compile_config"]["optimizer"]["config"]["layout"]
    assert layout["version"] == 1
    assert all(set(e) <= {"path", "kind", "shape", "n_trainable", "lr_scale"} for e in layout["variables"])
    assert {e["path"]: e["kind"] for e in layout["variables"]}["net/block/bias"] == "frozen"
    loaded = keras.models.load_model(path)
    assert same(values(weights_of(loaded)), values(weights_of(model)))
    ff.Freezer.of(loaded).verify()


@pytest.mark.parametrize(
    "change, found",
    [
        (lambda layout: layout.update(version=2), "is format 2"),
        (lambda layout: layout.update(version=0), "is format 0"),
        (lambda layout: layout.pop("version"), "has no format version"),
        (lambda layout: layout.pop("variables"), "is format 1 but lacks entries that format holds"),
        (lambda layout: layout["variables"][0].pop("kind"), "is format 1 but lacks entries that format holds"),
    ],
    ids=["newer", "older", "no-version", "no-variables", "no-kind"],
)
@pytest.mark.slow
def test_a_model_file_whose_layout_has_another_format_is_refused(tmp_path, change, found):
    model, path = saved_model(tmp_path)
    other = with_layout(path, tmp_path / "other.keras", change)
    with pytest.raises(ff.PlanError) as e:
        keras.models.load_model(other)
    message = str(e.value)
    assert f"the freeze layout in this model file's optimizer config {found}; " in message
    assert f"finefreeze {ff.__version__} reads format 1 only" in message
    assert f"Save the model again with finefreeze {ff.__version__}" in message
    # the file it was made from loads, and what it holds is the model as saved
    assert same(values(weights_of(keras.models.load_model(path))), values(weights_of(model)))


# -- the freeze record a FreezingOptimizer writes beside its variables in a checkpoint --------------------------


def with_record(path, change):
    """Edit in place the freeze record of the checkpoint at ``path`` (a ``.weights.h5``)."""
    with h5py.File(path, "r+") as f:
        record = json.loads(np.asarray(f[KEY], np.uint8).tobytes())
        change(record)
        del f[KEY]
        f[KEY] = np.frombuffer(json.dumps(record).encode(), np.uint8)


@INNER_SKIPPED
@pytest.mark.parametrize(
    "change, found",
    [
        (lambda rec: rec.update(version=2), "is format 2"),
        (lambda rec: rec.pop("version"), "has no format version"),
        (lambda rec: rec.pop("slots"), "is format 1 but lacks slots"),
        (lambda rec: rec["layout"].update(version=2), "is format 1 but its layout is format 2"),
    ],
    ids=["newer", "no-version", "no-slots", "layout-newer"],
)
@pytest.mark.slow
def test_a_checkpoint_whose_record_has_another_format_is_refused_and_nothing_changes(tmp_path, change, found):
    model, frz = build()
    model.fit(X, Y, epochs=1, verbose=0)
    good, other = tmp_path / "good.weights.h5", tmp_path / "other.weights.h5"
    model.save_weights(good)
    model.save_weights(other)
    with h5py.File(good) as f:
        record = json.loads(np.asarray(f[KEY], np.uint8).tobytes())
    assert record["version"] == 1 and record["layout"]["version"] == 1
    with_record(other, change)
    # the plan the checkpoint would put back is not the one in force; and the inner optimizer, of another
    # size now, is one Keras skips when it loads it on its own (it would load one of the file's size itself)
    frz.update(LATER)
    weights, state = values(weights_of(model)), values(model.optimizer.variables)
    masks = [frz.frozen_mask(p).copy() for p in ("net/block/kernel", "net/block/bias")]

    with pytest.raises(ValueError) as e:  # Keras reports what a load_own_variables raised in a ValueError
        model.load_weights(other)
    message = str(e.value)
    assert f"the checkpoint's freeze record ('finefreeze_checkpoint', beside the optimizer's variables) {found}; " in (
        message
    )
    assert f"finefreeze {ff.__version__} reads format 1 only" in message
    assert f"Resume from a checkpoint saved with finefreeze {ff.__version__}" in message
    assert same(values(weights_of(model)), weights) and same(values(model.optimizer.variables), state)
    assert frz.plan == LATER and not frz.frozen_mask("net/block/bias").any()
    assert all(np.array_equal(frz.frozen_mask(p), m) for p, m in zip(("net/block/kernel", "net/block/bias"), masks))

    model.load_weights(good)  # the checkpoint it was made from puts its plan back
    assert frz.plan == START and frz.frozen_mask("net/block/bias").all()
    frz.verify()


# -- a checkpoint without a record: loaded by position, as Keras loads its own optimizers ----------------------


@INNER_SKIPPED
def test_a_plain_keras_checkpoint_leaves_a_freezing_optimizer_as_keras_leaves_one_of_another_size(tmp_path):
    plain = keras.Sequential(layers())
    plain.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
    plain.fit(X, Y, epochs=1, verbose=0)
    plain.save_weights(tmp_path / "plain.weights.h5")
    model, frz = build()
    model.fit(X, Y, epochs=1, verbose=0)
    state = values(model.optimizer.variables)
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer 'freezing_optimizer'"):
        model.load_weights(tmp_path / "plain.weights.h5")
    assert same(values(weights_of(model)), values(weights_of(plain)))  # the layers load, as Keras loads them
    assert same(values(model.optimizer.variables), state) and frz.plan == START
