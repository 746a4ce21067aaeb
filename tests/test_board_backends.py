"""FreezeBoard on every Keras backend: its event files read back with TensorBoard's own reader.

Backend neutral: runs under ``KERAS_BACKEND=tensorflow``, ``jax`` and ``torch``.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import keras
import numpy as np
import PIL.Image
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

import finefreeze as ff
from backend_utils import gradients, two_dense
from finefreeze._cli.commands import main
from finefreeze._report.maskview import FROZEN_RGB, TRAINED_RGB

BACKEND = keras.backend.backend()
ROOT = pathlib.Path(__file__).resolve().parent.parent


def events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def values(acc, tag):
    """``[(step, value)]`` of a scalar tag, the value as written (float32)."""
    return [(e.step, make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]


def small(name="s"):
    """Two Dense layers, the same weights on every backend (numpy-seeded)."""
    return two_dense(name, 3, 4)


def data(n=16, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact", "mask"])
def test_tags_text_fractions_images_and_norms_read_back(tmp_path, strategy):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model, make_data

    model = build_text_model()
    plan = ff.Plan([*ff.Plan.from_dict(DEFAULT_PLAN).rules, ff.train("ff_in/bias[::4]")])
    frz = ff.Freezer(model, plan, strategy=strategy)
    opt = keras.optimizers.SGD(0.05) if strategy == "mask" else keras.optimizers.AdamW(0.01)
    model.compile(optimizer=frz.wrap(opt), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = make_data(96, new_tokens=True)
    board = ff.callbacks.FreezeBoard(tmp_path / "logs")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[board])
    acc = events(tmp_path / "logs")
    rep = frz.report()
    partial = ["token_embedding/embeddings", "ff_in/bias"]
    assert set(acc.Tags()["tensors"]) == {
        "freeze/summary",
        *(f"frozen_fraction/{v['path']}" for v in rep["variables"]),
        *(f"frozen_mask/{p}" for p in partial),
        "grad_norm/trainable",
        "grad_norm/frozen",
    }

    # the summary table as text, for the text plugin
    assert acc.SummaryMetadata("freeze/summary").plugin_data.plugin_name == "text"
    (text,) = [make_ndarray(e.tensor_proto).item().decode() for e in acc.Tensors("freeze/summary")]
    assert text == "```\n" + frz.summary() + "\n```"

    # the frozen fraction of every variable, as the Freezer reports it
    for v in rep["variables"]:
        tag = f"frozen_fraction/{v['path']}"
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        assert values(acc, tag) == [(0, np.float32(v["frozen_elements"] / v["elements"]))], tag

    # a mask image per partially frozen variable: PNG, its size, pixels colored by state
    for path, shape in (("token_embedding/embeddings", (544, 32)), ("ff_in/bias", (8, 8))):
        assert acc.SummaryMetadata(f"frozen_mask/{path}").plugin_data.plugin_name == "images"
        w, h, png = make_ndarray(acc.Tensors(f"frozen_mask/{path}")[0].tensor_proto)
        assert (int(w), int(h)) == (shape[1], shape[0])
        img = np.asarray(PIL.Image.open(__import__("io").BytesIO(png)))
        assert img.shape == (*shape, 3) and img.dtype == np.uint8
        frozen = frz.frozen_mask(path).reshape(shape)
        assert np.array_equal(img[frozen], np.broadcast_to(FROZEN_RGB, img[frozen].shape))
        assert np.array_equal(img[~frozen], np.broadcast_to(TRAINED_RGB, img[~frozen].shape))

    # gradient norms at every optimizer step; the last ones are the optimizer's
    trainable, blocked = values(acc, "grad_norm/trainable"), values(acc, "grad_norm/frozen")
    assert [s for s, _ in trainable] == list(range(1, 7)) == [s for s, _ in blocked]
    assert all(v > 0 for _, v in trainable + blocked)  # the loss pushes on frozen elements; the plan blocks it
    last = model.optimizer._gradient_norms()
    assert (trainable[-1][1], blocked[-1][1]) == (np.float32(last[0]), np.float32(last[1]))
    assert board.last_gradient_norms == last
    frz.verify()


def test_norms_are_the_loss_gradient_split_by_the_plan(tmp_path):
    model = small()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/kernel[0]"), ff.freeze("**/b/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data()
    kernel, bias = model.get_layer("a").kernel, model.get_layer("a").bias
    loss = keras.losses.MeanSquaredError()
    g_kernel, g_bias = (
        keras.ops.convert_to_numpy(g)
        for g in gradients(lambda: loss(y, model(x)), [kernel, bias])  # the first step's gradient
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[ff.callbacks.FreezeBoard(tmp_path)])
    acc = events(tmp_path)
    (step, trained), (_, blocked) = values(acc, "grad_norm/trainable")[0], values(acc, "grad_norm/frozen")[0]
    assert step == 1
    np.testing.assert_allclose(trained, np.sqrt((g_kernel[1:] ** 2).sum() + (g_bias**2).sum()), rtol=1e-5)
    np.testing.assert_allclose(blocked, np.sqrt((g_kernel[0] ** 2).sum()), rtol=1e-5)


def test_a_plan_change_in_fit_is_written_again(tmp_path):
    model = small()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/**")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    cbs = [
        ff.callbacks.FreezeSchedule({1: ff.Plan([ff.freeze("**/b/**"), ff.freeze("**/a/kernel[0]")])}),
        ff.callbacks.FreezeBoard(tmp_path, update_freq=2),
    ]
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=cbs)
    acc = events(tmp_path)
    assert [v for _, v in values(acc, "frozen_fraction/s/a/kernel")] == [1.0, np.float32(4 / 12)]
    assert [v for _, v in values(acc, "frozen_fraction/s/b/kernel")] == [0.0, 1.0]
    assert len(acc.Tensors("freeze/summary")) == 2
    blocked = values(acc, "grad_norm/frozen")
    assert [s for s, _ in blocked] == [2, 4, 6, 8]
    assert [v > 0 for _, v in blocked] == [False, False, True, True]  # a/kernel[0] is partial in epoch 2 only
    frz.verify()


def test_a_model_saved_after_freezeboard_loads_its_optimizer_state(tmp_path):
    model = small()
    frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/kernel[0]")]))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[ff.callbacks.FreezeBoard(tmp_path / "logs")])
    model.save(tmp_path / "m.keras")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Skipping variable loading for optimizer" would be one
        loaded = keras.models.load_model(tmp_path / "m.keras")
    norms = {id(v) for v in model.optimizer._enforcement.enforcers.norms}
    saved = [v for v in model.optimizer.variables if id(v) not in norms]
    assert len(model.optimizer.variables) == len(saved) + 2  # the norms ride along while tracked
    assert len(loaded.optimizer.variables) == len(saved)
    for a, b in zip(saved, loaded.optimizer.variables):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path


@pytest.mark.slow
def test_freezeboard_never_imports_tensorflow_off_the_tensorflow_backend(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import keras, numpy as np
        import finefreeze as ff
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**/kernel[0]")]))
        m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
        board = ff.callbacks.FreezeBoard({str(tmp_path)!r})
        m.fit(np.ones((8, 3)), np.zeros((8, 2)), batch_size=4, epochs=2, verbose=0, callbacks=[board])
        print(keras.backend.backend(), "tensorflow" in sys.modules)
        """
    )
    env = dict(
        os.environ,
        KERAS_BACKEND=BACKEND,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    # TensorFlow is there on its own backend only: neither FreezeBoard nor tensorboard's writer imports it
    assert got.stdout.split() == [BACKEND, str(BACKEND == "tensorflow")]
    assert [s for s, _ in values(events(tmp_path), "grad_norm/frozen")] == [1, 2, 3, 4]


def test_without_tensorboard_one_error_names_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        ff.callbacks.FreezeBoard(tmp_path / "logs")
    assert not (tmp_path / "logs").exists()
    # the command says so before any slow step, and writes nothing
    assert main(["finetune", "--out", str(tmp_path / "out"), "-q"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("finefreeze finetune: error: ") and line.endswith("pip install tensorboard")
    assert not (tmp_path / "out").exists()


def test_a_file_as_log_dir_is_refused_at_construction(tmp_path):
    (tmp_path / "events").write_text("not a folder")
    with pytest.raises(ValueError, match="a file is there; give a directory"):
        ff.callbacks.FreezeBoard(tmp_path / "events")
    assert (tmp_path / "events").read_text() == "not a folder"


@pytest.mark.parametrize("gradients_", ["auto", "sliced", "dense"])
def test_the_board_observes_training_gives_the_same_bits_with_and_without_it(tmp_path, gradients_):
    """The main job's model and plan (new token rows, the head, a sliced bias): FreezeBoard changes no bit."""
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model, make_data

    plan = ff.Plan([*ff.Plan.from_dict(DEFAULT_PLAN).rules, ff.train("ff_in/kernel[:, :4]")])
    x, y = make_data(96, new_tokens=True)

    def trained(callbacks):
        keras.utils.set_random_seed(3)
        model = build_text_model()
        frz = ff.Freezer(model, plan, gradients=gradients_)
        model.compile(
            optimizer=frz.wrap(keras.optimizers.AdamW(0.01)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        frz.verify()
        return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in model.weights], frz.summary()

    plain, plain_summary = trained([])
    board = ff.callbacks.FreezeBoard(tmp_path / "logs")
    watched, watched_summary = trained([board])
    assert board.last_gradient_norms is not None and board.last_gradient_norms[0] > 0
    assert watched_summary == plain_summary  # the same gradient path, as the summary names it
    assert len(watched) == len(plain)
    for a, b in zip(watched, plain):
        assert a.dtype == b.dtype and np.array_equal(a, b)
