"""Files written by finefreeze 0.x (``tests/data/release-0.x/``, made by its ``make_files.py``) keep working.

The model file resumes training as the run that wrote it did (frozen elements
bit for bit, trained ones within the rounding of another CPU),
``Freezer.of`` rebuilds a Freezer that verifies, the delta applies to its
base, the plan files load, and FreezeBoard writes the same tags and summary
as the log of that release.
"""

import importlib.util
import json
import pathlib
import zipfile

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

import finefreeze as ff
from backend_utils import weights_of

pytestmark = pytest.mark.backends("tensorflow", reason="the files hold TensorFlow optimizer variables")

HERE = pathlib.Path(__file__).parent / "data" / "release-0.x"


def _maker():
    spec = importlib.util.spec_from_file_location("release_0x_make_files", HERE / "make_files.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_the_files_are_those_of_the_previous_release():
    manifest = json.loads((HERE / "MANIFEST.json").read_text())
    assert manifest["finefreeze"].startswith("0.1")
    config = json.loads(zipfile.ZipFile(HERE / "mid_training.keras").read("config.json"))
    opt = config["compile_config"]["optimizer"]
    # the old module path and layout version 2 with its "strategy" key: what the loaders must still read
    assert opt["module"] == "finefreeze._optimizer"
    assert opt["config"]["layout"]["version"] == 2
    assert {e["strategy"] for e in opt["config"]["layout"]["variables"]} == {"frozen", "restore", "compact", "train"}


#: trained values against the file's continuation, relative to the largest: that run was made on another CPU,
#: whose float kernels may round the last bit of a sum differently (measured: 2.2e-7 on an AVX-512 machine)
ROUNDING = 1e-6


def test_a_saved_model_resumes_training_with_its_frozen_elements_bit_identical():
    model = keras.models.load_model(HERE / "mid_training.keras")
    frz = ff.Freezer.of(model)
    assert frz is not None
    frz.verify()
    assert frz._strategy_for("head/kernel") == "compact" and frz._strategy_for("mid/kernel") == "restore"
    saved = {v.path: np.array(v.numpy(), copy=True) for v in weights_of(model)}
    data = np.load(HERE / "data.npz")
    model.fit(data["x"], data["y"], batch_size=32, epochs=2, shuffle=False, verbose=0)
    frz.verify()
    expected = dict(np.load(HERE / "resumed.npz"))
    got = _maker().state(model)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        if key.startswith("weight:"):
            frozen = frz.frozen_mask(key.split(":", 2)[2])
            assert _same(got[key][frozen], value[frozen]) and _same(
                got[key][frozen], saved[key.split(":", 2)[2]][frozen]
            )
        if value.dtype.kind in "iu" or not np.any(value):
            assert _same(got[key], value), key  # counters and never-trained slots: the same bytes
        else:
            gap = float(np.abs(got[key].astype(np.float64) - value).max() / np.abs(value).max())
            assert gap <= ROUNDING, (key, gap)


def test_the_delta_applies_to_its_base_and_the_plan_files_load(tmp_path):
    maker = _maker()
    base = maker.build_model()
    base.load_weights(HERE / "base.weights.h5")
    ff.load_delta(base, HERE / "delta.safetensors")
    tuned = keras.models.load_model(HERE / "mid_training.keras")
    for a, b in zip(weights_of(base), weights_of(tuned)):
        assert _same(np.asarray(a.numpy()), np.asarray(b.numpy())), a.path
    for name in ("plan.json", "plan.toml"):
        assert ff.Plan.load(HERE / name) == maker.plan(), name


def _board(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    tags = sorted(acc.Tags()["tensors"])
    texts = {t: make_ndarray(acc.Tensors(t)[0].tensor_proto).tolist() for t in tags if t.startswith("finefreeze/")}
    return tags, texts


def test_freezeboard_writes_what_the_previous_release_wrote(tmp_path):
    maker = _maker()
    model = maker.build_model()
    frz = ff.Freezer(model, maker.plan())
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = maker.data()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[ff.callbacks.FreezeBoard(tmp_path)])
    old_tags, old_texts = _board(HERE / "board")
    new_tags, new_texts = _board(tmp_path)
    assert old_tags and new_tags == old_tags
    assert new_texts == old_texts


def test_a_model_saved_now_writes_layout_version_3_and_loads(tmp_path):
    model = keras.models.load_model(HERE / "mid_training.keras")
    model.save(tmp_path / "now.keras")
    config = json.loads(zipfile.ZipFile(tmp_path / "now.keras").read("config.json"))
    layout = config["compile_config"]["optimizer"]["config"]["layout"]
    assert layout["version"] == 3
    # the kind under "kind", and under "strategy" too, which release 0.1 reads
    assert all(e["kind"] == e["strategy"] for e in layout["variables"])
    again = keras.models.load_model(tmp_path / "now.keras")
    ff.Freezer.of(again).verify()
    assert {e.path: e.kind for e in ff.Freezer.of(again)._layout} == json.loads((HERE / "MANIFEST.json").read_text())[
        "layout"
    ]


@pytest.mark.slow
def test_a_file_of_the_previous_release_loads_after_import_finefreeze_alone():
    """Keras finds the class by its registered name; the module path the file names still imports to it."""
    import importlib
    import subprocess
    import sys

    code = (
        "import finefreeze, keras, sys; m = keras.models.load_model(sys.argv[1]); "
        "print(type(m.optimizer).__module__, type(m.optimizer).__name__)"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, str(HERE / "mid_training.keras")], capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stdout.split()[-1] == "FreezingOptimizer", got.stdout
    config = json.loads(zipfile.ZipFile(HERE / "mid_training.keras").read("config.json"))
    opt = config["compile_config"]["optimizer"]
    assert getattr(importlib.import_module(opt["module"]), opt["class_name"]) is ff.FreezingOptimizer


def test_a_layout_newer_than_this_release_is_refused_with_a_clear_error():
    from finefreeze._enforce.layout import Layout

    config = json.loads(zipfile.ZipFile(HERE / "mid_training.keras").read("config.json"))
    layout = dict(config["compile_config"]["optimizer"]["config"]["layout"], version=99)
    with pytest.raises(ff.PlanError, match="version 99, newer than this finefreeze reads"):
        Layout.from_config(layout, [], "auto")
