"""The ``finefreeze`` command on JAX and PyTorch, run in subprocesses from the TensorFlow suite.

Most runs make TensorFlow unimportable in the child (as where it is not
installed); the first ``verify`` runs as ``python -m finefreeze``.
"""

import json

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from finefreeze._cli.commands import main
from finefreeze._data.text_model import DEFAULT_PLAN
from test_backends import run_on

#: ``python -c`` of the command with TensorFlow unimportable
WITHOUT_TF = (
    "import sys; sys.modules['tensorflow'] = None; from finefreeze._cli.commands import main; "
    "code = main(sys.argv[1:]); assert sys.modules['tensorflow'] is None; sys.exit(code)"
)


def load(path):
    import finefreeze._data.text_model  # noqa: F401  (the bundled layers)

    return keras.models.load_model(path, compile=False)


def raw(path):
    return {v.path: np.array(v.numpy(), copy=True) for v in load(path).weights}


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.fixture(scope="module", params=["jax", "torch"])
def tuned(request, tmp_path_factory):
    """A bundled ``finetune`` run (2 epochs) on the backend, TensorFlow unimportable."""
    out = tmp_path_factory.mktemp(request.param) / "out"
    proc = run_on(request.param, "-c", WITHOUT_TF, "finetune", "--out", str(out), "--epochs", "2", "-q", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return request.param, out, proc


@pytest.mark.slow
def test_finetune_writes_every_output_and_learns(tuned):
    backend, out, proc = tuned
    assert proc.stderr == ""  # no warnings, no log lines
    (line,) = proc.stdout.strip().splitlines()  # -q: the final line only
    assert line.startswith("finefreeze finetune: val_accuracy ") and "verify OK" in line, line
    for name in ("base.keras", "tuned.keras", "delta.safetensors", "report.json"):
        assert (out / name).is_file(), name
    assert (out / "frozen.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "report.json").read_text())
    ft = rep["finetune"]
    assert ft["verified"] is True and ft["violations"] == []
    m = ft["metric"]
    assert m["name"] == "val_accuracy" and m["before"] < 0.5 < 0.8 < m["after"], m  # the new tokens were learned
    assert f"val_accuracy {m['before']:.4f} before, {m['after']:.4f} after" in line
    assert rep["totals"]["trainable_elements"] == 32 * 32 + 32 * 4 + 4

    # frozen elements bit-identical, trained ones moved
    base, after = raw(out / "base.keras"), raw(out / "tuned.keras")
    emb = "token_embedding/embeddings"
    assert same_bytes(base[emb][:512], after[emb][:512])
    assert not np.array_equal(base[emb][512:], after[emb][512:])
    for p in base:
        if not p.startswith(("token_embedding/", "head/")):
            assert same_bytes(base[p], after[p]), p

    # FreezeBoard's log, read with TensorBoard's reader
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["tensors"])
    assert {"freeze/summary", f"frozen_fraction/{emb}", f"frozen_mask/{emb}", "grad_norm/frozen"} <= tags
    fraction = make_ndarray(acc.Tensors(f"frozen_fraction/{emb}")[0].tensor_proto)
    assert fraction == np.float32(512 * 32 / (544 * 32))
    steps = 2 * 2048 // 64
    norms = [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors("grad_norm/frozen")]
    assert [s for s, _ in norms] == list(range(1, steps + 1))
    assert all(v > 0 for _, v in norms)  # the loss pushes on the old tokens' rows; the plan blocks it


@pytest.mark.slow
def test_verify_and_delta_apply_read_the_outputs(tuned, tmp_path, capsys):
    backend, out, _ = tuned
    ok = run_on(backend, "-m", "finefreeze", "verify", str(out / "base.keras"), str(out / "tuned.keras"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("OK: all 25,440 frozen elements")

    shown = run_on(backend, "-c", WITHOUT_TF, "inspect", str(out / "tuned.keras"), "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert json.loads(shown.stdout)["totals"]["frozen_elements"] == 25_440  # the plan saved in tuned.keras

    applied = tmp_path / "applied.keras"
    got = run_on(
        backend, "-c", WITHOUT_TF, "delta", "apply", str(out / "base.keras"), str(out / "delta.safetensors"),
        "-o", str(applied),
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    tuned_w, applied_w = raw(out / "tuned.keras"), raw(applied)
    assert tuned_w.keys() == applied_w.keys()
    for p in tuned_w:
        assert same_bytes(tuned_w[p], applied_w[p]), p

    # and fails, naming the element, when one bit of one frozen element differs
    model = load(out / "tuned.keras")
    kernel = model.get_layer("ff_in").kernel
    w = kernel.numpy()
    w.view(np.uint32)[3, 5] ^= 1
    kernel.assign(w)
    model.save(tmp_path / "tampered.keras")
    (tmp_path / "plan.json").write_text(json.dumps(DEFAULT_PLAN))
    bad = run_on(
        backend, "-c", WITHOUT_TF, "verify", str(out / "base.keras"), str(tmp_path / "tampered.keras"),
        "--plan", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "ff_in/kernel" in bad.stdout and "(3, 5)" in bad.stdout and "1 frozen element" in bad.stdout

    # the files are the same on every backend: TensorFlow verifies what this backend wrote, applies its delta
    assert main(["verify", str(out / "base.keras"), str(out / "tuned.keras")]) == 0
    assert capsys.readouterr().out.startswith("OK: all 25,440 frozen elements")
    assert (
        main(
            [
                "delta",
                "apply",
                str(out / "base.keras"),
                str(out / "delta.safetensors"),
                "-o",
                str(tmp_path / "tf.keras"),
            ]
        )
        == 0
    )
    got_tf = raw(tmp_path / "tf.keras")
    assert all(same_bytes(tuned_w[p], got_tf[p]) for p in tuned_w)


@pytest.mark.parametrize(
    "backend, code, missing",
    [
        ("jaxx", "from finefreeze._cli.commands import main; import sys; sys.exit(main(sys.argv[1:]))", "jaxx"),
        ("tensorflow", WITHOUT_TF, "No module named 'tensorflow"),
    ],
)
def test_a_backend_that_cannot_load_is_one_line_that_names_keras_backend(backend, code, missing, tmp_path):
    proc = run_on(backend, "-c", code, "inspect", cwd=tmp_path, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("finefreeze inspect: error: ") and missing in lines[0], lines[0]
    assert f"KERAS_BACKEND={backend}" in lines[0], lines[0]
    assert "installed here: KERAS_BACKEND=" in lines[0] and "KERAS_BACKEND=jax" in lines[0], lines[0]  # not pip


def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """``finefreeze inspect | head -c 10``: the closed pipe ends the command quietly."""
    import os
    import subprocess
    import sys

    from test_backends import ROOT

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), KERAS_BACKEND="jax")
    cmd = f"set -o pipefail; {sys.executable} -m finefreeze inspect | head -c 10 >/dev/null"
    got = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert got.stderr == "", got.stderr[-2000:]
    assert got.returncode in (0, 141), got.returncode  # 0 when inspect had written everything before head left
