"""Outputs that cannot be half-written, refusals that change nothing, interrupts, broken model files.

A command runs in a process of its own where the process is what is tested
(interrupts, what reaches stderr), in this one otherwise.
"""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from finefreeze._cli.commands import main
from test_cli import run_cli as run_here

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
#: the environment of a person's shell: no TensorFlow quieting of our own
ENV = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
ENV["PYTHONPATH"] = SRC + os.pathsep + os.environ.get("PYTHONPATH", "")


def cli(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "finefreeze", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        **kw,
    )


def run_cli(*args):
    """The command in a process of its own: its exit code, stdout and stderr."""
    proc = cli(*args)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def tree(folder):
    """Every file under ``folder`` with its bytes (hidden ones included)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def one_error_line(err, *expected):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for e in expected:
        assert e in lines[0], err
    return lines[0]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A complete bundled run (1 epoch) in ``out``."""
    out = tmp_path_factory.mktemp("done") / "out"
    got = run_here("finetune", "--out", out, "--epochs", "1", "-q")
    assert got.returncode == 0, got.stderr[-3000:]
    assert got.stderr == ""  # no warnings
    return out


@pytest.mark.slow
def test_a_used_out_is_refused_without_force_and_nothing_changes(done):
    before = tree(done)
    got = run_here("finetune", "--out", done, "--epochs", "1", "-q")
    assert got.returncode == 2
    one_error_line(got.stderr, "--force", str(done))
    assert tree(done) == before


@pytest.mark.slow
def test_no_command_writes_over_its_input(done, tmp_path):
    before = tree(done)
    plan = tmp_path / "plan.json"
    from finefreeze._data.text_model import DEFAULT_PLAN, make_data

    plan.write_text(json.dumps(DEFAULT_PLAN))
    x, y = make_data(64, new_tokens=True)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    tuned = done / "tuned.keras"
    cases = [
        ("finetune", tuned, "--data", tmp_path / "d.npz", "--plan", plan, "--out", done, "--force"),
        ("delta", "apply", done / "base.keras", done / "delta.safetensors", "-o", done / "base.keras", "--force"),
        ("delta", "export", tuned, "-o", tuned, "--force"),
    ]
    for argv in cases:
        code = main([str(a) for a in argv])
        assert code == 2, argv
    assert tree(done) == before


def test_existing_output_files_need_force(tmp_path, capsys):
    import finefreeze as ff
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    m = build_text_model()
    frz = ff.Freezer(m, ff.Plan.from_dict(DEFAULT_PLAN))
    m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
    m.save(tmp_path / "t.keras")
    (tmp_path / "d.safetensors").write_bytes(b"keep me")
    assert main(["delta", "export", str(tmp_path / "t.keras"), "-o", str(tmp_path / "d.safetensors")]) == 2
    one_error_line(capsys.readouterr().err, "--force", "d.safetensors")
    assert (tmp_path / "d.safetensors").read_bytes() == b"keep me"
    assert main(["delta", "export", str(tmp_path / "t.keras"), "-o", str(tmp_path / "d.safetensors"), "--force"]) == 0
    capsys.readouterr()
    applied = tmp_path / "applied.keras"
    applied.write_bytes(b"keep me too")
    args = ["delta", "apply", str(tmp_path / "t.keras"), str(tmp_path / "d.safetensors"), "-o", str(applied)]
    assert main(args) == 2
    one_error_line(capsys.readouterr().err, "--force")
    assert applied.read_bytes() == b"keep me too"
    assert main([*args, "--force"]) == 0
    tuned = keras.models.load_model(tmp_path / "t.keras", compile=False)
    assert keras.models.load_model(applied, compile=False).count_params() == tuned.count_params()
    assert sorted(os.listdir(tmp_path)) == ["applied.keras", "d.safetensors", "t.keras"]  # no temporary left


def test_out_that_is_a_file_or_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["finetune", "--out", str(out), "-q"]) == 2
        one_error_line(capsys.readouterr().err, "finefreeze finetune: error:", str(tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "x"


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    d = tmp_path_factory.mktemp("broken")
    from finefreeze._data.text_model import build_text_model

    build_text_model().save(d / "good.keras")
    data = (d / "good.keras").read_bytes()
    (d / "truncated.keras").write_bytes(data[: len(data) // 2])
    (d / "folder.keras").mkdir()
    (d / "text.keras").write_text("not a model\n")
    return d


@pytest.mark.parametrize(
    "name, expected",
    [("truncated", "damaged or truncated"), ("folder", "is a folder"), ("text", "is not a Keras model file")],
)
def test_broken_model_files_are_one_line_exit_2(broken, name, expected, capsys):
    bad, good = str(broken / f"{name}.keras"), str(broken / "good.keras")
    for argv in (
        ["inspect", bad],
        ["verify", good, bad],
        ["finetune", bad, "--out", str(broken / "out")],
        ["delta", "export", bad, "-o", str(broken / "x.safetensors")],
        ["delta", "apply", bad, str(broken / "x.safetensors"), "-o", str(broken / "y.keras")],
    ):
        assert main(argv) == 2, argv
        one_error_line(capsys.readouterr().err, expected, bad)
    assert not (broken / "out").exists() and not (broken / "y.keras").exists()


def test_inspect_a_model_without_a_plan_lists_everything_as_trainable(tmp_path, capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="user")
    model.save(tmp_path / "user.keras")
    assert main(["inspect", str(tmp_path / "user.keras")]) == 0
    out = capsys.readouterr().out
    assert "holds no finefreeze plan" in out and "--plan" in out
    assert "token_embedding" not in out
    assert main(["inspect", str(tmp_path / "user.keras"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["plan"] == []
    assert {v["path"]: v["state"] for v in rep["variables"]} == {"d/kernel": "trainable", "d/bias": "trainable"}


def wait_for(proc, cond, what):
    t = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() - t < 240, f"timed out waiting for {what}"
        time.sleep(0.002)


def staged(out, name):
    def cond():
        try:
            dirs = [d for d in os.listdir(out) if d.startswith(".finefreeze-tmp-")]
        except FileNotFoundError:
            return False
        return any(os.path.exists(os.path.join(out, d, name)) for d in dirs)

    return cond


def interrupt(proc):
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("point", ["training", "saving the model", "drawing the picture"])
def test_interrupt_leaves_the_previous_run_complete(done, point):
    before = tree(done)
    epochs = 40 if point == "training" else 1
    proc = cli("finetune", "--out", done, "--epochs", epochs, "--force", "-q")
    if point == "training":
        wait_for(proc, staged(done, "tensorboard"), point)
        time.sleep(1.0)  # well inside fit
    elif point == "saving the model":
        wait_for(proc, staged(done, "tuned.keras"), point)
    else:
        wait_for(proc, staged(done, "delta.safetensors"), point)
    code, err = interrupt(proc)
    assert code == 130, err[-3000:]
    one_error_line(err, "interrupted")
    after = tree(done)
    kept = {k for k in after if k.startswith(".finefreeze-resume" + os.sep)}
    mine = {k: v for k, v in after.items() if k not in kept}
    assert mine == {k: v for k, v in before.items() if not k.startswith(".finefreeze-resume" + os.sep)}
    if point != "training":  # fit finished: the resume point holds its last epoch, for --resume
        assert {".finefreeze-resume/settings.json", ".finefreeze-resume/latest.weights.h5"} <= kept


@pytest.mark.slow
def test_interrupt_at_start_leaves_no_out_folder(tmp_path):
    out = tmp_path / "fresh"
    proc = cli("finetune", "--out", out)
    first = proc.stdout.readline()
    assert first.startswith("finefreeze finetune: pretraining"), first
    code, err = interrupt(proc)
    assert code == 130, err[-3000:]
    one_error_line(err, "interrupted")
    assert not out.exists()


@pytest.mark.slow
def test_other_commands_print_nothing_on_stderr(done, tmp_path):
    for argv in (
        ["inspect", done / "tuned.keras"],
        ["verify", done / "base.keras", done / "tuned.keras"],
        ["delta", "export", done / "tuned.keras", "-o", tmp_path / "d.safetensors"],
        ["delta", "apply", done / "base.keras", tmp_path / "d.safetensors", "-o", tmp_path / "a.keras"],
    ):
        code, out, err = run_cli(*argv)
        assert code == 0 and err == "", (argv, err[-2000:])


@pytest.mark.slow
def test_force_replaces_a_previous_run_whole(done, tmp_path):
    import shutil

    from finefreeze._data.text_model import DEFAULT_PLAN, make_data

    out = tmp_path / "out"
    shutil.copytree(done, out)
    assert main(["delta", "apply", str(out / "base.keras"), str(out / "delta.safetensors")]) == 0  # into out
    assert main(["delta", "export", str(out / "tuned.keras")]) == 0
    old_events = set(os.listdir(out / "tensorboard"))
    old_tuned = (out / "tuned.keras").read_bytes()
    shutil.copy(done / "base.keras", tmp_path / "model.keras")
    (tmp_path / "plan.json").write_text(json.dumps(DEFAULT_PLAN))
    x, y = make_data(256, new_tokens=True, seed=3)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    argv = ["finetune", tmp_path / "model.keras", "--data", tmp_path / "d.npz", "--plan", tmp_path / "plan.json"]
    got = run_here(*argv, "--out", out, "--epochs", "1", "--force", "-q")
    assert got.returncode == 0 and got.stderr == "", got.stderr[-3000:]
    for stale in ("base.keras", "rebuilt.keras", "exported-delta.safetensors"):  # the previous run's are gone
        assert not (out / stale).exists(), stale
    assert (out / "tuned.keras").read_bytes() != old_tuned
    events = set(os.listdir(out / "tensorboard"))
    assert events and not events & old_events  # one run's TensorBoard files, not two
    assert not [f for f in os.listdir(out) if f.startswith(".")]
    got = run_here("verify", tmp_path / "model.keras", out / "tuned.keras")
    assert got.returncode == 0, got.stdout + got.stderr


DROPPED_INTERRUPT = """
import signal, weakref
from finefreeze._files.atomic import catch_interrupts, check_interrupt

class Thing:
    pass

def callback(_):
    signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the callback
    for _ in range(1000):
        pass

with catch_interrupts():
    thing = Thing()
    ref = weakref.ref(thing, callback)
    del thing  # Python prints and drops a KeyboardInterrupt raised in a weakref callback
    assert ref() is None
    print("after the callback")
    try:
        check_interrupt()
    except KeyboardInterrupt:
        print("stopped")
"""


def test_an_interrupt_python_drops_in_a_callback_still_stops_the_command():
    proc = subprocess.run(
        [sys.executable, "-c", DROPPED_INTERRUPT], capture_output=True, text=True, env=ENV, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["after the callback", "stopped"]
    assert proc.stderr == ""  # no "Exception ignored in ... KeyboardInterrupt" traceback


def test_force_never_replaces_files_no_run_wrote(tmp_path, capsys):
    """Names like ours without a report.json are someone else's files: refused even with --force."""
    out = tmp_path / "mine"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "notes.txt").write_text("mine")
    (out / "base.keras").write_bytes(b"not ours")
    before = tree(out)
    assert main(["finetune", "--out", str(out), "--force", "-q"]) == 2
    one_error_line(capsys.readouterr().err, "no finefreeze run wrote", "base.keras", "tensorboard")
    assert tree(out) == before


def test_delta_export_that_cannot_write_is_one_line_exit_2(done, capsys):
    assert main(["delta", "export", str(done / "tuned.keras"), "-o", "/proc/finefreeze-test.safetensors"]) == 2
    one_error_line(capsys.readouterr().err)


def test_budget_without_select_is_refused(tmp_path, capsys):
    assert main(["finetune", "--budget", "0.05", "--out", str(tmp_path / "o"), "-q"]) == 2
    one_error_line(capsys.readouterr().err, "--budget goes with --select")
    assert not (tmp_path / "o").exists()


@pytest.mark.backends("tensorflow", reason="it starts its children on the backends it tests, whatever this run's")
@pytest.mark.parametrize(
    "backend, hide, missing",
    [("jaxx", False, "jaxx"), ("tensorflow", True, "No module named 'tensorflow")],
)
@pytest.mark.slow
def test_a_backend_that_cannot_load_is_one_line_that_names_keras_backend(backend, hide, missing, tmp_path):
    env = dict(ENV, KERAS_BACKEND=backend)
    code = "from finefreeze._cli.commands import main; import sys; sys.exit(main(sys.argv[1:]))"
    if hide:
        code = "import sys; sys.modules['tensorflow'] = None; " + code
    proc = subprocess.run(
        [sys.executable, "-c", code, "inspect"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("finefreeze inspect: error: ") and missing in lines[0], lines[0]
    assert f"KERAS_BACKEND={backend}" in lines[0], lines[0]
    assert "installed here: KERAS_BACKEND=" in lines[0] and "KERAS_BACKEND=jax" in lines[0], lines[0]  # not pip


@pytest.mark.slow
def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """``finefreeze inspect | head -c 10``: the closed pipe ends the command quietly."""
    cmd = f"set -o pipefail; {sys.executable} -m finefreeze inspect | head -c 10 >/dev/null"
    got = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert got.stderr == "", got.stderr[-2000:]
    assert got.returncode in (0, 141), got.returncode  # 0 when inspect had written everything before head left


REFUSALS_WITHOUT_A_FRAMEWORK = """
import sys
from finefreeze._cli.commands import main
root = sys.argv[1]
cases = [
    ["finetune", root + "/nope.keras", "--data", "d.npz", "--plan", "p.json"],
    ["finetune", "--out", root + "/used"],
    ["finetune", "--data", root + "/nope.npz"],
    ["finetune", root + "/m.keras", "--data", root + "/d.npz", "--plan", root + "/nope.json"],
    ["verify", root + "/nope.keras", root + "/m.keras"],
    ["verify", root + "/m.keras", root + "/m.keras", "--plan", root + "/nope.json"],
    ["inspect", root + "/nope.keras"],
    ["delta", "export", root + "/nope.keras", "-o", root + "/d.safetensors"],
    ["delta", "apply", root + "/m.keras", root + "/nope.safetensors", "-o", root + "/o.keras"],
    ["delta", "apply", root + "/m.keras", root + "/d.npz", "-o", root + "/exists.keras"],
    ["delta", "export", root + "/m.keras", "-o", root + "/exists.keras"],
    ["delta", "apply", root + "/m.keras", root + "/d.npz", "-o", root + "/nodir/o.keras"],
    ["delta", "apply", root + "/m.keras", root + "/d.npz"],  # its default output, rebuilt.keras beside d.npz
    ["delta", "export", root + "/m.keras"],  # its default output, exported-delta.safetensors beside m.keras
]
for argv in cases:
    code = main(argv)
    loaded = sorted(m for m in ("keras", "tensorflow", "jax", "torch") if m in sys.modules)
    print(code, ",".join(loaded) or "-", flush=True)
"""


def test_refusals_that_need_no_framework_come_before_one_loads(tmp_path):
    """A missing file or a used --out is said in well under a second, before Keras or a backend is imported."""
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "report.json").write_text("{}")
    import zipfile

    with zipfile.ZipFile(tmp_path / "m.keras", "w") as z:  # looks like a model file; never loaded
        z.writestr("config.json", "{}")
    (tmp_path / "d.npz").write_bytes(b"")
    (tmp_path / "exists.keras").write_bytes(b"")
    (tmp_path / "rebuilt.keras").write_bytes(b"")
    (tmp_path / "exported-delta.safetensors").write_bytes(b"")
    got = subprocess.run(
        [sys.executable, "-c", REFUSALS_WITHOUT_A_FRAMEWORK, str(tmp_path)], env=ENV, capture_output=True, text=True
    )
    lines = got.stdout.splitlines()
    assert len(lines) == 14, got.stderr[-2000:]
    assert all(line == "2 -" for line in lines), (lines, got.stderr[-2000:])
    errors = [e for e in got.stderr.splitlines() if e.startswith("finefreeze ")]
    assert len(errors) == 14 and all(
        any(w in e for w in ("does not exist", "another run", "no config.json", "pass --force")) for e in errors
    ), errors


@pytest.mark.parametrize("quantized", [None, "int8"])
def test_the_end_line_names_every_file_relative_to_the_working_folder(tmp_path, monkeypatch, quantized):
    from finefreeze._cli.result import Result

    monkeypatch.chdir(tmp_path)
    metric = {"name": "val_accuracy", "before": 0.1, "after": 0.9}
    result = Result(
        out=str(tmp_path / "run"), trainable_elements=1, frozen_elements=2, verified=True, delta_bytes=10,
        weights_bytes=100, files={}, history={}, metric=metric, base=str(tmp_path / "base.keras"), quantized=quantized,
    )  # fmt: skip
    rest = result.line().split(". Check: ", 1)[1]  # the commands to run next, pasted as they are
    assert rest.startswith("finefreeze verify base.keras run/tuned.keras;"), rest
    assert str(tmp_path) not in rest and "run/delta.safetensors" in rest, rest
