"""``finefreeze delta export`` and ``delta apply``: where they write, and ``verify`` on what ``apply`` wrote."""

import io
import os
import subprocess
import sys
import zipfile

import h5py
import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from finefreeze._cli.commands import build_parser, main
from finefreeze._cli.inputs import plan_from_keras_file
from test_cli import load, raw
from test_cli_outputs import ENV, one_error_line


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder as ``finetune`` leaves it: ``base.keras``, ``tuned.keras`` (trained under the bundled plan)
    and ``delta.safetensors``."""
    from finefreeze._cli.finetune import loss_for
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model, make_data

    folder = tmp_path_factory.mktemp("run") / "finefreeze-out"
    folder.mkdir()
    build_text_model().save(folder / "base.keras")
    model = load(folder / "base.keras")
    frz = ff.Freezer(model, ff.Plan.from_dict(DEFAULT_PLAN))
    x, y = make_data(128, new_tokens=True)
    loss, _ = loss_for(model, y)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss=loss)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    frz.verify()
    model.save(folder / "tuned.keras")
    frz.save_delta(folder / "delta.safetensors")
    return folder


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The working folder is another one: nothing may land there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def flip_bit(src, dst, shape, index):
    """Copy the ``.keras`` file ``src`` to ``dst`` with the lowest bit of one float32 flipped: the element at
    ``index`` of the only model variable of ``shape`` (the optimizer's state is not looked at); its config (and
    the plan in it) as it was."""
    with zipfile.ZipFile(src) as z:
        files = {n: z.read(n) for n in z.namelist()}
    buf = io.BytesIO(files["model.weights.h5"])
    with h5py.File(buf, "r+") as f:
        found = []
        f.visititems(
            lambda name, o: (
                found.append(name)
                if isinstance(o, h5py.Dataset) and o.shape == shape and not name.startswith("optimizer/")
                else None
            )
        )
        assert len(found) == 1, found
        values = f[found[0]][...]
        values.view(np.uint32)[index] ^= 1
        f[found[0]][...] = values
    files["model.weights.h5"] = buf.getvalue()
    with zipfile.ZipFile(dst, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


@pytest.mark.slow
def test_apply_writes_rebuilt_keras_beside_the_delta_says_so_and_it_verifies(run, elsewhere, capsys):
    out = run / "rebuilt.keras"
    try:
        assert main(["delta", "apply", str(run / "base.keras"), str(run / "delta.safetensors")]) == 0
        said = capsys.readouterr().out
        assert said.startswith(f"wrote {out}: 1,156 elements in 3 variables"), said
        assert f"check: finefreeze verify {run / 'base.keras'} {out}" in said
        assert os.listdir(elsewhere) == []
        tuned, got = raw(load(run / "tuned.keras")), raw(load(out))
        assert tuned.keys() == got.keys()
        for p in tuned:
            assert np.array_equal(tuned[p].view(np.uint8), got[p].view(np.uint8)), p
        # the plan the delta was trained under, with the model: its rules as written
        assert plan_from_keras_file(str(out)) == plan_from_keras_file(str(run / "tuned.keras"))
        assert main(["verify", str(run / "base.keras"), str(out)]) == 0
        assert capsys.readouterr().out.startswith(f"OK: all 25,440 frozen elements of {out} are bit-identical")
    finally:
        out.unlink(missing_ok=True)


def test_verify_fails_on_a_frozen_element_changed_after_apply_and_passes_on_a_trained_one(run, tmp_path, capsys):
    out = tmp_path / "applied.keras"
    assert main(["delta", "apply", str(run / "base.keras"), str(run / "delta.safetensors"), "-o", str(out)]) == 0
    capsys.readouterr()
    base = str(run / "base.keras")
    for name, shape, index in [("ff_in", (32, 64), (3, 5)), ("row", (544, 32), (3, 5))]:  # a frozen row of 512
        bad = tmp_path / f"{name}.keras"
        flip_bit(out, bad, shape, index)
        assert main(["verify", base, str(bad)]) == 1
        said = capsys.readouterr().out
        assert said.startswith("FAILED") and "(3, 5)" in said and "1 frozen element" in said, said
        assert ("ff_in/kernel" if name == "ff_in" else "token_embedding/embeddings") in said
    trained = tmp_path / "trained.keras"
    flip_bit(out, trained, (544, 32), (520, 5))  # a new token's row: the delta trained it
    assert main(["verify", base, str(trained)]) == 0
    assert capsys.readouterr().out.startswith("OK:")


def test_export_writes_beside_the_model_and_the_delta_rebuilds_it(run, elsewhere, tmp_path, capsys):
    exported = run / "exported-delta.safetensors"
    try:
        assert main(["delta", "export", str(run / "tuned.keras")]) == 0
        assert capsys.readouterr().out.startswith(f"wrote {exported}: ")
        assert os.listdir(elsewhere) == []
        out = tmp_path / "again.keras"
        assert main(["delta", "apply", str(run / "base.keras"), str(exported), "--out", str(out)]) == 0
        tuned, got = raw(load(run / "tuned.keras")), raw(load(out))
        for p in tuned:
            assert np.array_equal(tuned[p].view(np.uint8), got[p].view(np.uint8)), p
        assert main(["delta", "export", str(run / "tuned.keras")]) == 2  # the default output is used now
        one_error_line(capsys.readouterr().err, "exported-delta.safetensors", "--force")
    finally:
        exported.unlink(missing_ok=True)


def test_a_default_output_that_is_the_input_is_refused(run, tmp_path, capsys):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "rebuilt.keras").write_bytes((run / "base.keras").read_bytes())
    (folder / "delta.safetensors").write_bytes((run / "delta.safetensors").read_bytes())
    before = (folder / "rebuilt.keras").read_bytes()
    argv = ["delta", "apply", str(folder / "rebuilt.keras"), str(folder / "delta.safetensors"), "--force"]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, "over its own input")
    assert (folder / "rebuilt.keras").read_bytes() == before


def test_deltas_of_disjoint_elements_apply_with_a_plan_of_what_they_write(run, tmp_path, capsys):
    """Two deltas: the model carries a plan that trains exactly their elements; verify checks all the others."""
    model = load(run / "base.keras")
    rows = tmp_path / "rows" / "rows.safetensors"
    rows.parent.mkdir()
    for path, rules, bump in [
        (rows, [ff.train("token_embedding/embeddings[512:]")], 1.0),
        (tmp_path / "head.safetensors", [ff.train("head/kernel[0]")], 2.0),
    ]:
        m = load(run / "base.keras")
        frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), *rules]), gradients="dense")
        for v in weights_of(m):
            if frz.variable_state(v.path) != "frozen":
                v.assign(np.where(frz.frozen_mask(v.path), v.numpy(), v.numpy() + bump))
        frz.save_delta(path)
    assert main(["delta", "apply", str(run / "base.keras"), str(rows), str(tmp_path / "head.safetensors")]) == 0
    out = rows.parent / "rebuilt.keras"  # beside the first delta
    assert capsys.readouterr().out.startswith(f"wrote {out}: {32 * 32 + 4:,} elements in 2 variables")
    frz = ff.Freezer(model, plan_from_keras_file(str(out)))
    trained = {v.path: ~frz.frozen_mask(v.path) for v in weights_of(model)}
    assert frz.report()["totals"]["trainable_elements"] == 32 * 32 + 4
    assert trained["token_embedding/embeddings"][512:].all() and not trained["token_embedding/embeddings"][:512].any()
    assert trained["head/kernel"][0].all() and not trained["head/kernel"][1:].any() and not trained["head/bias"].any()
    assert main(["verify", str(run / "base.keras"), str(out)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.keras"
    flip_bit(out, bad, (32, 4), (1, 2))  # head/kernel row 1: neither delta trained it
    assert main(["verify", str(run / "base.keras"), str(bad)]) == 1
    assert "head/kernel: 1 frozen element" in capsys.readouterr().out


def test_one_spelling_of_the_output_option_on_every_command(tmp_path):
    parser = build_parser()
    for argv, want in [
        (["finetune", "-o", "run"], "run"),
        (["finetune", "--out", "run"], "run"),
        (["delta", "export", "t.keras", "-o", "d.safetensors"], "d.safetensors"),
        (["delta", "apply", "b.keras", "d.safetensors", "--out", "o.keras"], "o.keras"),
        (["delta", "apply", "b.keras", "d.safetensors"], None),
    ]:
        assert parser.parse_args(argv).out == want, argv
    for argv in (
        ["delta", "export", "t.keras", "--output", "d.safetensors"],
        ["delta", "apply", "b.keras", "d.safetensors", "--output", "o.keras"],
        ["finetune", "--output", "run"],
    ):
        got = subprocess.run(
            [sys.executable, "-m", "finefreeze", *argv], cwd=tmp_path, env=ENV, capture_output=True, text=True
        )
        assert got.returncode == 2 and "unrecognized arguments: --output" in got.stderr, (argv, got.stderr)
        assert os.listdir(tmp_path) == []


def test_a_delta_without_a_plan_file_form_applies_with_the_plan_of_its_elements(run, tmp_path, capsys):
    """A plan with ``where=`` cannot be written as a plan: the model carries the elements the delta wrote."""
    m = load(run / "base.keras")
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("head/kernel", where=lambda w: w > 0)]))
    head = m.get_layer("head").kernel
    positive = head.numpy() > 0
    head.assign(np.where(positive, head.numpy() + 1.0, head.numpy()))
    frz.save_delta(tmp_path / "d.safetensors")
    out = tmp_path / "rebuilt.keras"
    assert main(["delta", "apply", str(run / "base.keras"), str(tmp_path / "d.safetensors")]) == 0
    plan = plan_from_keras_file(str(out))
    assert np.array_equal(ff.Freezer(load(run / "base.keras"), plan).frozen_mask("head/kernel"), ~positive)
    assert main(["verify", str(run / "base.keras"), str(out)]) == 0
    capsys.readouterr()
    frozen = tuple(int(i) for i in np.argwhere(~positive)[0])
    flip_bit(out, tmp_path / "bad.keras", (32, 4), frozen)
    assert main(["verify", str(run / "base.keras"), str(tmp_path / "bad.keras")]) == 1
    assert f"head/kernel: 1 frozen element(s) differ at {frozen}" in capsys.readouterr().out


def test_a_recorded_plan_that_trains_more_on_the_whole_model_gives_way_to_the_deltas_elements(run, tmp_path, capsys):
    """A delta of one layer records a plan that, on the whole model, would train every other layer too:
    the model carries the elements the delta wrote, and a changed element elsewhere fails verify."""
    m = load(run / "base.keras")
    frz = ff.Freezer(m.get_layer("head"), ff.Plan([ff.freeze("**/bias")]))  # the head's kernel trains
    kernel = m.get_layer("head").kernel
    kernel.assign(kernel.numpy() + 1.0)
    frz.save_delta(tmp_path / "d.safetensors")
    assert main(["delta", "apply", str(run / "base.keras"), str(tmp_path / "d.safetensors")]) == 0
    out = tmp_path / "rebuilt.keras"
    assert ff.Freezer(load(out), plan_from_keras_file(str(out))).report()["totals"]["trainable_elements"] == 32 * 4
    assert main(["verify", str(run / "base.keras"), str(out)]) == 0
    capsys.readouterr()
    flip_bit(out, tmp_path / "bad.keras", (32, 64), (3, 5))
    assert main(["verify", str(run / "base.keras"), str(tmp_path / "bad.keras")]) == 1
    assert "ff_in/kernel: 1 frozen element(s) differ at (3, 5)" in capsys.readouterr().out


def test_a_delta_of_a_live_sequential_applies_to_its_saved_base_and_verifies(tmp_path):
    """A loaded Sequential names its variables without the model's name; apply binds the delta as load_delta does."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="backbone"), keras.layers.Dense(2, name="head")], name="mlp"
    )
    m.save(tmp_path / "base.keras")
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/backbone/kernel[:, :4]")]))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    m.fit(np.random.rand(32, 8), np.random.rand(32, 2), epochs=1, verbose=0)
    frz.save_delta(tmp_path / "d.safetensors")
    assert main(["delta", "apply", str(tmp_path / "base.keras"), str(tmp_path / "d.safetensors")]) == 0
    assert main(["verify", str(tmp_path / "base.keras"), str(tmp_path / "rebuilt.keras")]) == 0
    rebuilt = load(tmp_path / "rebuilt.keras")
    for a, b in zip(weights_of(rebuilt), weights_of(m)):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.path


def test_apply_refuses_an_output_that_is_not_a_keras_file(run, tmp_path, capsys):
    code = main(
        ["delta", "apply", str(run / "base.keras"), str(run / "delta.safetensors"), "-o", str(tmp_path / "x.h5")]
    )
    assert code == 2 and not (tmp_path / "x.h5").exists()
    one_error_line(capsys.readouterr().err, "give a name ending in .keras")


def test_a_damaged_config_is_said_to_be_damaged_not_to_hold_no_plan(run, tmp_path, capsys):
    with zipfile.ZipFile(run / "tuned.keras") as z:
        info = z.getinfo("config.json")
    raw_bytes = bytearray((run / "tuned.keras").read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)  # the file's data
    raw_bytes[start + info.compress_size // 2] ^= 0x01
    bad = tmp_path / "bad.keras"
    bad.write_bytes(bytes(raw_bytes))
    for argv in (["verify", str(run / "base.keras"), str(bad)], ["inspect", str(bad)]):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        one_error_line(err, "is damaged: its config.json does not read")
        assert "no finefreeze plan" not in out + err
