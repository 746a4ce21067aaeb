"""The ``finefreeze`` command line, end to end, in this process (exit codes and signals: tests/test_cli_outputs.py, tests/test_cli_signals.py)."""

import contextlib
import io
import json
import subprocess

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from finefreeze._cli.commands import main


def run_cli(*args) -> subprocess.CompletedProcess:
    """``finefreeze ARGS`` in this process: its exit code and what it wrote to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    keras.config.enable_interactive_logging()  # as in a fresh process (the suite turns it off)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    finally:
        keras.config.disable_interactive_logging()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("finefreeze ")]


def load(path):
    import finefreeze._data.text_model  # noqa: F401

    return keras.models.load_model(path, compile=False)


def raw(model):
    return {v.path: np.array(v.numpy(), copy=True) for v in weights_of(model)}


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "out"
    proc = run_cli("finetune", "--out", out, "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_finetune_on_bundled_defaults_writes_everything(tuned_dir):
    out, proc = tuned_dir
    for name in ("base.keras", "tuned.keras", "delta.safetensors", "report.json", "frozen.png"):
        assert (out / name).is_file(), name
    assert any(f.name.startswith("events.out.tfevents") for f in (out / "tensorboard").iterdir())
    assert "Freeze plan:" in proc.stdout and "Epoch 1/2" in proc.stdout  # summary, Keras progress
    assert "\x1b[" not in proc.stdout  # stdout is a pipe: one line per epoch, no cursor codes in a log
    assert "AdamW state" in proc.stdout  # the summary names the optimizer that trains
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "finefreeze finetune: pretraining the bundled text model ..."  # before any slow step
    last = lines[-1]
    assert last.startswith("finefreeze finetune:") and "verify OK" in last and "delta" in last
    rep = json.loads((out / "report.json").read_text())
    assert rep["finetune"]["verified"] is True
    metric = rep["finetune"]["metric"]
    assert metric["name"] == "val_accuracy" and metric["before"] < 0.5 < 0.8 < metric["after"]
    assert f"val_accuracy {metric['before']:.4f} before, {metric['after']:.4f} after" in last
    assert metric["after"] == rep["finetune"]["history"]["val_accuracy"][-1]
    assert rep["totals"]["trainable_elements"] == 32 * 32 + 32 * 4 + 4
    assert rep["finetune"]["history"]["val_accuracy"][-1] > 0.8  # the new tokens were learned
    base, tuned = raw(load(out / "base.keras")), raw(load(out / "tuned.keras"))
    emb = "token_embedding/embeddings"
    assert np.array_equal(base[emb][:512], tuned[emb][:512])
    assert not np.array_equal(base[emb][512:], tuned[emb][512:])
    assert np.array_equal(base["ff_in/kernel"], tuned["ff_in/kernel"])


@pytest.mark.slow
def test_verify_passes_then_names_a_flipped_frozen_value(tuned_dir, tmp_path):
    out, _ = tuned_dir
    ok = run_cli("verify", out / "base.keras", out / "tuned.keras")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("OK:")
    model = load(out / "tuned.keras")
    k = model.get_layer("ff_in").kernel
    v = k.numpy()
    v.view(np.uint32)[3, 5] ^= 1  # one bit of one frozen element
    k.assign(v)
    model.save(tmp_path / "tampered.keras")
    bad = run_cli("verify", out / "base.keras", tmp_path / "tampered.keras", "--plan", plan_file(tmp_path))
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "ff_in/kernel" in bad.stdout and "(3, 5)" in bad.stdout and "1 frozen element" in bad.stdout


@pytest.mark.slow
def test_verify_with_its_arguments_swapped_says_so(tuned_dir, capsys):
    out, _ = tuned_dir
    assert main(["verify", str(out / "tuned.keras"), str(out / "base.keras")]) == 2
    err = capsys.readouterr().err.strip()
    assert "the order is `finefreeze verify BASE TUNED`" in err and "did you mean" in err
    assert err.endswith(f"`finefreeze verify {out / 'base.keras'} {out / 'tuned.keras'}`?")


def plan_file(tmp_path):
    from finefreeze._data.text_model import DEFAULT_PLAN

    p = tmp_path / "plan.json"
    p.write_text(json.dumps(DEFAULT_PLAN))
    return p


@pytest.mark.slow
def test_delta_export_apply_reproduces_tuned_and_refuses_other_bases(tuned_dir, tmp_path):
    out, _ = tuned_dir
    delta, applied = tmp_path / "d.safetensors", tmp_path / "applied.keras"
    assert run_cli("delta", "export", out / "tuned.keras", "-o", delta).returncode == 0
    res = run_cli("delta", "apply", out / "base.keras", delta, "-o", applied)
    assert res.returncode == 0, res.stderr[-2000:]
    tuned, got = raw(load(out / "tuned.keras")), raw(load(applied))
    assert tuned.keys() == got.keys()
    for p in tuned:
        assert np.array_equal(tuned[p].view(np.uint8), got[p].view(np.uint8)), p

    from finefreeze._data.text_model import build_text_model

    build_text_model(seed=7).save(tmp_path / "other.keras")
    other = run_cli("delta", "apply", tmp_path / "other.keras", delta, "-o", tmp_path / "x.keras")
    assert other.returncode == 2 and "fingerprint mismatch" in error_lines(other.stderr)[0]
    assert not (tmp_path / "x.keras").exists()

    (tmp_path / "cut.safetensors").write_bytes(delta.read_bytes()[:100])
    cut = run_cli("delta", "apply", out / "base.keras", tmp_path / "cut.safetensors", "-o", tmp_path / "y.keras")
    assert cut.returncode == 2 and "damaged or truncated" in error_lines(cut.stderr)[0]
    assert "Traceback" not in cut.stderr


ACROSS = """
import sys
from finefreeze._cli.commands import main
base, tuned, delta, applied = sys.argv[1:]
assert main(["verify", base, tuned]) == 0
assert main(["delta", "apply", base, delta, "-o", applied]) == 0
"""


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="it starts JAX and PyTorch children itself")
@pytest.mark.parametrize("other", ["jax", "torch"])
def test_the_files_are_the_same_on_every_backend(tuned_dir, other, tmp_path):
    """What TensorFlow wrote verifies on JAX and PyTorch, and its delta applies there bit for bit."""
    import os
    import sys

    out, _ = tuned_dir
    applied = tmp_path / "applied.keras"
    env = dict(os.environ, KERAS_BACKEND=other)
    argv = [out / "base.keras", out / "tuned.keras", out / "delta.safetensors", applied]
    got = subprocess.run([sys.executable, "-c", ACROSS, *map(str, argv)], env=env, capture_output=True, text=True)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    assert got.stdout.startswith("OK: all 25,440 frozen elements"), got.stdout
    tuned, applied_w = raw(load(out / "tuned.keras")), raw(load(applied))
    assert tuned.keys() == applied_w.keys()
    for p in tuned:
        assert np.array_equal(tuned[p].view(np.uint8), applied_w[p].view(np.uint8)), p


def test_every_command_has_help():
    for cmd in (["finetune"], ["inspect"], ["verify"], ["delta"], ["delta", "export"], ["delta", "apply"]):
        with pytest.raises(SystemExit) as e:
            main([*cmd, "--help"])
        assert e.value.code == 0


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    from finefreeze._data.text_model import build_text_model

    build_text_model().save(d / "m.keras")
    return d / "m.keras"


def bad_inputs(tmp_path, model):
    plan = plan_file(tmp_path)
    (tmp_path / "broken.json").write_text('{"rules": [{"freeze": "**"}, {"train": ')
    np.savez(tmp_path / "shapes.npz", x=np.zeros((8, 7), "int32"), y=np.zeros(8, "int32"))
    np.savez(tmp_path / "labels.npz", x=np.zeros((8, 16), "int32"), y=np.full(8, 9, "int32"))
    np.savez(tmp_path / "nokeys.npz", inputs=np.zeros((8, 16)))
    np.savez(tmp_path / "ids.npz", x=np.full((8, 16), 10_000, "int32"), y=np.zeros(8, "int32"))
    return {
        "missing model": (["finetune", tmp_path / "nope.keras"], "does not exist"),
        "missing data": (["finetune", model, "--plan", plan, "--data", tmp_path / "nope.npz"], "does not exist"),
        "malformed plan": (["inspect", "--plan", tmp_path / "broken.json"], "broken.json"),
        "plan typo": (["inspect", "--plan", typo_plan(tmp_path)], "selects nothing"),
        "wrong x shape": (["finetune", model, "--plan", plan, "--data", tmp_path / "shapes.npz"], "(8, 7)"),
        "labels out of range": (["finetune", model, "--plan", plan, "--data", tmp_path / "labels.npz"], "4 outputs"),
        "no x/y arrays": (["finetune", model, "--plan", plan, "--data", tmp_path / "nokeys.npz"], "'x' and 'y'"),
        "token ids out of range": (
            ["finetune", model, "--plan", plan, "--data", tmp_path / "ids.npz"],
            "rows (ids 0..",
        ),
        "unknown optimizer": (["finetune", "--optimizer", "adamx"], "unknown optimizer 'adamx'"),
        "missing delta": (
            ["delta", "apply", model, tmp_path / "nope.safetensors", "-o", tmp_path / "o.keras"],
            "does not exist",
        ),
        "verify without plan": (["verify", model, model], "holds no finefreeze plan"),
    }


def typo_plan(tmp_path):
    p = tmp_path / "typo.json"
    p.write_text('{"rules": [{"freeze": "encodr/**"}]}')
    return p


@pytest.mark.parametrize(
    "case",
    [
        "missing model",
        "missing data",
        "malformed plan",
        "plan typo",
        "wrong x shape",
        "labels out of range",
        "no x/y arrays",
        "token ids out of range",
        "unknown optimizer",
        "missing delta",
        "verify without plan",
    ],
)
def test_bad_input_exits_2_with_one_line(case, tmp_path, small_model, capsys):
    argv, expected = bad_inputs(tmp_path, small_model)[case]
    if argv[0] == "finetune":  # its own --out: parallel tests never share the working folder's finefreeze-out
        argv = [*argv, "--out", tmp_path / "finefreeze-out"]
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "finefreeze-out").exists()


def test_inspect_bundled_defaults_json():
    out = run_cli("inspect", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    emb = next(v for v in rep["variables"] if v["path"] == "token_embedding/embeddings")
    assert emb["state"] == "partial" and emb["trainable_elements"] == 32 * 32


def test_inspect_reads_the_plan_saved_in_a_tuned_model(tmp_path):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    m = build_text_model()
    frz = ff.Freezer(m, ff.Plan.from_dict(DEFAULT_PLAN))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    m.save(tmp_path / "t.keras")
    assert main(["inspect", str(tmp_path / "t.keras"), "--layers-only"]) == 0


def test_inspect_names_the_optimizer_a_model_was_saved_with(tmp_path, capsys):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    m = build_text_model()
    frz = ff.Freezer(m, ff.Plan.from_dict(DEFAULT_PLAN))
    m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    m.save(tmp_path / "t.keras")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "t.keras"), "--layers-only"]) == 0
    out = capsys.readouterr().out
    assert "SGD state" in out and "Adam" not in out


def test_delta_apply_combines_deltas_of_disjoint_elements_and_refuses_overlaps(small_model, tmp_path, capsys):
    def delta(name, rules, bump):
        model = load(small_model)
        frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), *rules]), gradients="dense")
        for v in model.weights:
            if frz.variable_state(v.path) != "frozen":
                trained = ~frz.frozen_mask(v.path)
                v.assign(np.where(trained, v.numpy() + bump, v.numpy()))
        frz.save_delta(tmp_path / name)
        return raw(model)

    rows = delta("rows.safetensors", [ff.train("token_embedding/embeddings[512:]")], 1.0)
    head = delta("head.safetensors", [ff.train("head/**")], 2.0)
    delta("both.safetensors", [ff.train("head/kernel[0]")], 3.0)
    base = raw(load(small_model))
    assert main(["delta", "apply", str(small_model), str(tmp_path / "rows.safetensors"), str(tmp_path / "head.safetensors"), "-o", str(tmp_path / "o.keras")]) == 0  # fmt: skip
    assert "from " in capsys.readouterr().out
    got = raw(load(tmp_path / "o.keras"))
    for p, b in base.items():
        want = rows[p] if not np.array_equal(rows[p], b) else head[p]
        assert np.array_equal(got[p], want), p
    code = main(["delta", "apply", str(small_model), str(tmp_path / "head.safetensors"), str(tmp_path / "both.safetensors"), "-o", str(tmp_path / "x.keras")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "both write 'head/kernel'" in err and "(0, 0)" in err, err
    assert not (tmp_path / "x.keras").exists()
