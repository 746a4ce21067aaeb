"""FreezeBoard's TensorBoard event files (read back with TensorBoard's reader) and Freezer.plot."""

import sys

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

import finefreeze as ff
from finefreeze._report.maskview import FROZEN_RGB, TRAINED_RGB


def png_pixels(data: bytes) -> np.ndarray:
    """The uint8 pixels of a PNG, read with matplotlib (a test dependency)."""
    import io

    import matplotlib.image

    return (matplotlib.image.imread(io.BytesIO(data), format="png") * 255).round().astype(np.uint8)


def model_and_freezer(strategy="auto"):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    m = build_text_model()
    plan = ff.Plan.from_dict(DEFAULT_PLAN)
    plan = ff.Plan([*plan.rules, ff.train("ff_in/bias[::4]"), ff.train("ff_out/kernel[:, 0]")])
    return m, ff.Freezer(m, plan, strategy=strategy)


def events(log_dir):
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact", "mask"])
def test_freezeboard_writes_table_fractions_masks_and_gradient_norms(tmp_path, strategy):
    from finefreeze._data.text_model import make_data

    m, frz = model_and_freezer(strategy)
    opt = keras.optimizers.SGD(0.05) if strategy == "mask" else keras.optimizers.AdamW(0.01)
    m.compile(optimizer=frz.wrap(opt), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = make_data(96, new_tokens=True)
    m.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[ff.callbacks.FreezeBoard(tmp_path)])
    acc = events(tmp_path)
    tags = acc.Tags()["tensors"]

    # the summary table, as text
    assert acc.SummaryMetadata("freeze/summary").plugin_data.plugin_name == "text"
    text = acc.Tensors("freeze/summary")[0].tensor_proto.string_val[0].decode()
    assert "token_embedding" in text and "Trainable elements: " in text

    # the frozen fraction of every variable Keras trains
    rep = frz.report()
    for v in rep["variables"]:
        got = float(make_ndarray(acc.Tensors(f"frozen_fraction/{v['path']}")[0].tensor_proto))
        assert got == pytest.approx(v["frozen_elements"] / v["elements"], abs=1e-7), v["path"]

    # mask images: a 2-D variable as it is, a vector folded, pixels colored by state
    for path, shape in (("token_embedding/embeddings", (544, 32)), ("ff_out/kernel", (64, 32)), ("ff_in/bias", (8, 8))):
        assert acc.SummaryMetadata(f"frozen_mask/{path}").plugin_data.plugin_name == "images"
        w, h, png = make_ndarray(acc.Tensors(f"frozen_mask/{path}")[0].tensor_proto)[:3]
        img = png_pixels(png)
        assert img.shape == (*shape, 3) and (int(w), int(h)) == (shape[1], shape[0])
        frozen = frz.frozen_mask(path).reshape(shape)
        assert np.array_equal(img[frozen], np.broadcast_to(FROZEN_RGB, img[frozen].shape))
        assert np.array_equal(img[~frozen], np.broadcast_to(TRAINED_RGB, img[~frozen].shape))
    assert not any(t.startswith("frozen_mask/ln_1") for t in tags)  # fully frozen: no image by default

    # gradient norms at every optimizer step, of what trains and of what the plan blocked
    # (their values are checked against a tape in tests/test_seams.py)
    steps = 2 * 3
    tn = [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors("grad_norm/trainable")]
    fn = [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors("grad_norm/frozen")]
    assert [s for s, _ in tn] == list(range(1, steps + 1)) == [s for s, _ in fn]
    assert all(v > 0 for _, v in tn)
    assert all(v > 0 for _, v in fn)  # the loss pushes on frozen elements; the plan blocks it


def test_freezeboard_without_a_freezer_says_how_to_fix(tmp_path):
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss="mse")
    with pytest.raises(TypeError, match="FreezeBoard needs a Freezer"):
        m.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0, callbacks=[ff.callbacks.FreezeBoard(tmp_path)])


def test_freezeboard_images_all_and_update_freq(tmp_path):
    m = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")], name="s"
    )
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/a/**")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    board = ff.callbacks.FreezeBoard(tmp_path, frz, update_freq=2, images="all")
    m.fit(np.ones((16, 3)), np.ones((16, 2)), batch_size=4, verbose=0, callbacks=[board])
    acc = events(tmp_path)
    assert {"frozen_mask/s/a/kernel", "frozen_mask/s/b/kernel"} <= set(acc.Tags()["tensors"])
    assert [e.step for e in acc.Tensors("grad_norm/trainable")] == [2, 4]
    with pytest.raises(ValueError, match="images="):
        ff.callbacks.FreezeBoard(tmp_path, images="some")


def test_plot_writes_a_png(tmp_path):
    _, frz = model_and_freezer()
    path = frz.plot(tmp_path / "frozen.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = png_pixels(data)
    assert img.shape[0] > 300 and img.shape[1] > 600
    # both colors are drawn
    rgb = img[..., :3].reshape(-1, 3)
    assert (rgb == FROZEN_RGB).all(axis=1).any() and (rgb == TRAINED_RGB).all(axis=1).any()


def test_plot_without_matplotlib_gives_the_install_hint(tmp_path, monkeypatch):
    _, frz = model_and_freezer()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'finefreeze\[plot\]'"):
        frz.plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_freezeboard_writes_the_plan_again_when_it_changes(tmp_path):
    m = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="a"), keras.layers.Dense(2, name="b")], name="s"
    )
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/a/**")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    cbs = [ff.callbacks.FreezeSchedule({1: ff.Plan([ff.freeze("**/b/**")])}), ff.callbacks.FreezeBoard(tmp_path)]
    m.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, epochs=2, verbose=0, callbacks=cbs)
    acc = events(tmp_path)
    fractions = [float(make_ndarray(e.tensor_proto)) for e in acc.Tensors("frozen_fraction/s/a/kernel")]
    assert fractions == [1.0, 0.0]
    assert len(acc.Tensors("freeze/summary")) == 2
