"""The command line under real signals: SIGTERM like Ctrl-C, killed runs cleaned up, ``--resume`` bit for bit.

Clusters and container runtimes send SIGTERM before they stop a job, and
SIGKILL when it does not stop in time. Each test here sends the real signal
to a real ``finefreeze`` process.
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

import finefreeze
from finefreeze._files.atomic import Staging
from test_cli_outputs import wait_for  # noqa: E402  (tests/ is on the path)

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")


def cli(*args):
    cmd = [sys.executable, "-m", "finefreeze", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def epochs_saved(out) -> int:
    try:
        with open(os.path.join(out, ".finefreeze-resume", "training_metadata.json")) as f:
            return int(json.load(f)["epoch"])
    except (OSError, ValueError, KeyError):
        return 0


def staging_folders(out):
    return sorted(d for d in os.listdir(out) if d.startswith(".finefreeze-tmp-"))


def weights_and_state(path):
    import finefreeze  # noqa: F401  (registers the bundled model's layers)

    model = keras.models.load_model(path)
    return [np.asarray(w).tobytes() for w in model.get_weights()] + [
        np.asarray(keras.ops.convert_to_numpy(v)).tobytes() for v in model.optimizer.variables
    ]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A model file, data and plan for runs of a few seconds with 64 steps per epoch."""
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model, make_data

    d = tmp_path_factory.mktemp("job")
    build_text_model().save(d / "base.keras")
    (d / "plan.json").write_text(json.dumps(DEFAULT_PLAN))
    x, y = make_data(4096, new_tokens=True, seed=3)
    np.savez(d / "data.npz", x=x, y=y)
    return ["finetune", d / "base.keras", "--data", d / "data.npz", "--plan", d / "plan.json", "--epochs", 5, "-q"]


@pytest.mark.slow
def test_sigterm_then_sigkill_then_resume_ends_as_the_uninterrupted_run(job, tmp_path):
    straight = tmp_path / "straight"
    code, _, err = finish(cli(*job, "--out", straight))
    assert code == 0, err[-3000:]

    out = tmp_path / "out"
    proc = cli(*job, "--out", out)
    wait_for(proc, lambda: epochs_saved(out) >= 1, "the first epoch")
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 143, err[-3000:]
    assert "interrupted by SIGTERM; no file was left half-written; rerun the same command with --resume" in err
    assert staging_folders(out) == [] and os.listdir(out) == [".finefreeze-resume"]

    code, _, err = finish(cli(*job, "--out", out))  # not asked to resume: refused, nothing lost
    assert code == 2 and "holds the resume point of an interrupted run" in err and "--resume" in err

    proc = cli(*job, "--out", out, "--resume")
    wait_for(proc, lambda: epochs_saved(out) >= 3, "the third epoch")
    proc.send_signal(signal.SIGKILL)  # no handler runs: the staging folder stays behind
    code, _, _ = finish(proc)
    assert code == -signal.SIGKILL
    left = staging_folders(out)
    assert left == [f".finefreeze-tmp-{proc.pid}"]

    code, stdout, err = finish(cli(*job, "--out", out, "--resume"))
    assert code == 0, err[-3000:]
    assert err.strip() == (
        f"finefreeze finetune: removed {out / left[0]}, left by a run that was killed (process {proc.pid} is gone)"
    )
    assert sorted(os.listdir(out)) == sorted(os.listdir(straight))  # no staging folder, no resume point
    assert weights_and_state(out / "tuned.keras") == weights_and_state(straight / "tuned.keras")
    report = json.loads((out / "report.json").read_text())["finetune"]
    assert report["resumed_after_epoch"] >= 3 and len(report["history"]["loss"]) == 5 - report["resumed_after_epoch"]
    assert (out / "delta.safetensors").read_bytes() != b""


@pytest.mark.slow
def test_a_resumed_run_with_dropout_draws_the_masks_of_the_uninterrupted_run(tmp_path):
    """Dropout's seed states are not weights: the resume point keeps them beside the weights."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = keras.layers.Dropout(0.3)(keras.layers.Dense(32, activation="relu", name="a")(inp))
    keras.Model(inp, keras.layers.Dense(3, name="head")(h)).save(tmp_path / "base.keras")
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(8192, 16)).astype("float32"), y=rng.integers(0, 3, 8192))
    (tmp_path / "plan.json").write_text(json.dumps({"rules": [{"freeze": "**/a/bias"}]}))
    job = ["finetune", tmp_path / "base.keras", "--data", tmp_path / "d.npz", "--plan", tmp_path / "plan.json"]
    job += ["--epochs", 4, "--batch-size", 16, "-q"]
    code, _, err = finish(cli(*job, "--out", tmp_path / "straight"))
    assert code == 0, err[-3000:]
    out = tmp_path / "out"
    proc = cli(*job, "--out", out)
    wait_for(proc, lambda: epochs_saved(out) >= 1, "the first epoch")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc)[0] == 143
    code, _, err = finish(cli(*job, "--out", out, "--resume"))
    assert code == 0, err[-3000:]
    assert json.loads((out / "report.json").read_text())["finetune"]["resumed_after_epoch"] >= 1
    assert weights_and_state(out / "tuned.keras") == weights_and_state(tmp_path / "straight" / "tuned.keras")


#: a real process that receives ``{signal}`` as its command line's modules start to import (about 0.2 s after start)
SIGNAL_WHILE_LOADING = """
import os, sys

class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "finefreeze._cli.commands":
            os.kill(os.getpid(), {signal})
        return None

sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["finefreeze", "inspect"]
from finefreeze._cli.entry import main
sys.exit(main())
"""


@pytest.mark.parametrize("sig, code, how", [(signal.SIGINT, 130, ""), (signal.SIGTERM, 143, " by SIGTERM")])
def test_a_signal_while_the_command_line_loads_says_one_line_and_exits_with_its_code(sig, code, how):
    script = SIGNAL_WHILE_LOADING.format(signal=int(sig))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert (proc.returncode, proc.stdout) == (code, ""), proc.stderr[-2000:]
    assert proc.stderr == f"finefreeze: interrupted{how} while it loaded; nothing was written\n"


def test_a_command_started_ignoring_ctrl_c_keeps_ignoring_it():
    # as a script's shell starts `finefreeze ... &`: a Ctrl-C while it loads and one while it runs (as it imports
    # Keras) change nothing
    script = SIGNAL_WHILE_LOADING.format(signal=int(signal.SIGINT))
    script = script.replace('name == "finefreeze._cli.commands"', 'name in ("finefreeze._cli.commands", "keras")')
    script = script.replace('"inspect"]', '"inspect", "--json"]')
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["totals"]["trainable_elements"] > 0


def test_the_console_script_and_python_m_run_the_entry_that_catches_early_signals():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"] == {"finefreeze": "finefreeze._cli.entry:main"}
    with open(os.path.join(os.path.dirname(finefreeze.__file__), "__main__.py")) as f:
        assert "from finefreeze._cli.entry import main\n" in f.read()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_signal_after_the_last_line_never_changes_the_exit_status(delay):
    proc = cli("inspect", "--json")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.rstrip() == "}":  # the report is complete
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    code, rest, err = finish(proc)
    assert code == 0, err[-2000:]
    assert json.loads("".join(lines) + rest)["totals"]["trainable_elements"] > 0


def test_only_staging_folders_of_dead_processes_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    (tmp_path / f".finefreeze-tmp-{dead}").mkdir()
    (tmp_path / f".finefreeze-tmp-{dead}" / ".finefreeze-staging").write_text(f"{dead}\n")  # a staging folder
    (tmp_path / f".finefreeze-tmp-{dead}" / "tuned.keras").write_bytes(b"partial")
    (tmp_path / f".finefreeze-tmp-{dead + 1}").mkdir()  # the user's folder of that name: no mark
    (tmp_path / f".finefreeze-tmp-{dead + 1}" / "notes.txt").write_text("mine")
    (tmp_path / f".finefreeze-tmp-{os.getppid()}").mkdir()  # a live process's: never touched
    (tmp_path / f".finefreeze-tmp-{os.getppid()}" / ".finefreeze-staging").write_text(f"{os.getppid()}\n")
    (tmp_path / ".finefreeze-tmp-notapid").mkdir()
    (tmp_path / f".finefreeze-tmp-{dead}0").write_text("a file, not a staging folder")
    (tmp_path / "mine.txt").write_text("the user's")
    with Staging(tmp_path, ["report.json"], force=False, inputs=()) as stage:
        assert stage.removed == [f".finefreeze-tmp-{dead}"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [
            f".finefreeze-tmp-{os.getppid()}",
            f".finefreeze-tmp-{dead + 1}",
            ".finefreeze-tmp-notapid",
            f".finefreeze-tmp-{dead}0",
            "mine.txt",
        ]
    )


def test_an_error_a_signal_caused_inside_a_library_is_the_interrupt(monkeypatch, capsys):
    """Python raises ``KeyboardInterrupt`` wherever the program is; a library may turn it into its own error."""
    from finefreeze._cli import commands

    def command_hit_inside_a_library(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise TypeError("int() argument must be a string, not 'TensorShape'") from None
        return 0

    monkeypatch.setattr(commands, "cmd_inspect", command_hit_inside_a_library)
    assert commands.main(["inspect"]) == 130
    err = capsys.readouterr().err
    assert "interrupted; no file was left half-written" in err and "TypeError" not in err


@pytest.mark.slow
def test_an_error_a_signal_caused_after_training_keeps_the_resume_point(monkeypatch, capsys, tmp_path):
    """A signal a library turns into its own error while the picture is drawn: the epochs trained stay resumable."""
    import finefreeze as ff
    from finefreeze._cli import commands

    def plot_hit_by_the_signal(self, path, **kw):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError("the figure could not be drawn") from None

    monkeypatch.setattr(ff.Freezer, "plot", plot_hit_by_the_signal)
    out = tmp_path / "out"
    assert commands.main(["finetune", "--out", str(out), "--epochs", "1", "-q"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "--resume to continue after epoch 1" in err and "RuntimeError" not in err
    kept = set(os.listdir(out / ".finefreeze-resume"))
    assert {"settings.json", "latest.weights.h5"} <= kept, kept
    assert sorted(os.listdir(out)) == [".finefreeze-resume"]  # no output of the run is in place


def _signal_in_the_second_batch(signum, seen: list):
    """The command's interrupt callback, which also sends ``signum`` as ``fit``'s second batch begins."""
    from finefreeze._cli.epochs import stop_on_interrupt

    class SignalInsideTheSecondBatch(type(stop_on_interrupt())):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:  # inside fit's step loop, before the step runs
                signal.raise_signal(signum)
                seen.append("went on after the signal")

        def on_train_batch_end(self, batch, logs=None):
            seen.append(f"batch {batch} ended")
            super().on_train_batch_end(batch, logs)

    return SignalInsideTheSecondBatch


@pytest.mark.slow
def test_a_signal_inside_a_training_step_stops_fit_when_the_step_is_done(monkeypatch, capsys, tmp_path):
    """The first signal only marks the run interrupted; the batch it came in ends, then fit stops at its end.

    Unwinding from inside a framework's step frees what its threads still use
    (TensorFlow may then die of a corrupted heap); a second signal still stops
    the command at once.
    """
    from finefreeze._cli import finetune as cli_finetune
    from finefreeze._cli.commands import main

    seen = []
    monkeypatch.setattr(cli_finetune, "stop_on_interrupt", _signal_in_the_second_batch(signal.SIGTERM, seen))
    assert main(["finetune", "--out", str(tmp_path / "out"), "--epochs", "1", "-q"]) == 143
    assert seen == ["batch 0 ended", "went on after the signal", "batch 1 ended"]
    assert "interrupted by SIGTERM" in capsys.readouterr().err


def test_a_second_signal_stops_at_once(monkeypatch):
    """Inside ``interrupts_at_checks`` the first signal waits for a check; a second raises where it lands."""
    from finefreeze._files import atomic
    from finefreeze._files.atomic import Terminated, catch_interrupts, check_interrupt, interrupts_at_checks

    monkeypatch.setattr(atomic, "_interrupted", 0)  # this test's signal is not left to the tests after it

    got = []
    with pytest.raises(KeyboardInterrupt):
        with catch_interrupts(), interrupts_at_checks():
            signal.raise_signal(signal.SIGINT)
            got.append("first")
            try:
                signal.raise_signal(signal.SIGTERM)
                got.append("second did not stop it")
            except Terminated:
                got.append("second")
                check_interrupt()
    assert got == ["first", "second"]


@pytest.mark.slow
def test_a_signal_in_the_bundled_models_pretraining_stops_it_at_the_batchs_end(monkeypatch, capsys, tmp_path):
    """The bundled base is pretrained by a ``fit`` of its own: a signal stops it between two batches too."""
    from finefreeze._cli import epochs, finetune  # noqa: F401  (finetune's own name stays the real callback)
    from finefreeze._cli.commands import main

    seen = []
    monkeypatch.setattr(epochs, "stop_on_interrupt", _signal_in_the_second_batch(signal.SIGINT, seen))
    out = tmp_path / "out"
    assert main(["finetune", "--out", str(out), "--epochs", "1", "-q"]) == 130
    assert seen == ["batch 0 ended", "went on after the signal", "batch 1 ended"]  # stopped in pretraining's epoch 1
    assert "interrupted; no file was left half-written" in capsys.readouterr().err
    assert not out.exists() or os.listdir(out) == []


@pytest.mark.slow
def test_a_run_resumes_on_its_own_backend_only_and_a_finished_run_is_not_resumed(monkeypatch, capsys, tmp_path):
    """The bundled base is pretrained on the backend, and a step's bits depend on it: another backend is refused."""
    import finefreeze as ff
    from finefreeze._cli.commands import main

    def plot_hit_by_the_signal(self, path, **kw):
        signal.raise_signal(signal.SIGINT)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(ff.Freezer, "plot", plot_hit_by_the_signal)
        assert main(["finetune", "--out", str(out), "--epochs", "1", "-q"]) == 130
    settings = out / ".finefreeze-resume" / "settings.json"
    saved = json.loads(settings.read_text())
    assert saved["backend"] == keras.backend.backend()
    other = "jax" if keras.backend.backend() != "jax" else "torch"
    settings.write_text(json.dumps({**saved, "backend": other}))  # as a run on another backend wrote it
    before = sorted(os.listdir(out / ".finefreeze-resume"))
    capsys.readouterr()
    assert main(["finetune", "--out", str(out), "--epochs", "1", "-q", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"another KERAS_BACKEND ('{other}' then, '{keras.backend.backend()}' now)" in err, err
    assert sorted(os.listdir(out / ".finefreeze-resume")) == before and os.listdir(out) == [".finefreeze-resume"]

    settings.write_text(json.dumps(saved))
    assert main(["finetune", "--out", str(out), "--epochs", "1", "-q", "--resume"]) == 0
    capsys.readouterr()
    assert main(["finetune", "--out", str(out), "--epochs", "1", "-q", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "finished (its report.json is there): there is nothing to resume" in err, err
