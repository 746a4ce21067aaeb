"""``import finefreeze`` is light, and files finefreeze writes load with it alone."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import finefreeze as ff

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def python(code: str, *, quiet_env: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not quiet_env:
        env.pop("TF_CPP_MIN_LOG_LEVEL", None)
        env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_import_finefreeze_imports_neither_tensorflow_nor_keras():
    code = (
        "import sys, json, finefreeze as ff\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'jax', 'torch'))\n"
        "print(json.dumps({'heavy': heavy, 'all': ff.__all__, 'dir': dir(ff)}))\n"
    )
    proc = python(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["heavy"] == []
    assert set(got["all"]) <= set(got["dir"])


def test_every_public_name_is_the_object_its_private_module_defines():
    import inspect

    for name in ff.__all__:
        if name == "tf1" and keras.backend.backend() != "tensorflow":
            continue  # graph code imports TensorFlow: tested on its backend
        obj = getattr(ff, name)
        if inspect.ismodule(obj):
            assert obj.__name__ == f"finefreeze.{name}" and obj.__all__, name
        else:
            assert obj.__module__.startswith("finefreeze._") and obj.__name__ == name, name
    from finefreeze import Freezer, load_delta

    assert Freezer is ff.Freezer and load_delta is ff.load_delta
    assert ff.callbacks.FreezeBoard.__module__ == "finefreeze._callbacks.board"
    with pytest.raises(AttributeError, match="no_such_name"):
        ff.no_such_name  # noqa: B018


def test_the_public_surface_is_what_users_call():
    """The sizes release 0.1 promises: a flat namespace, and classes whose public members are user verbs."""
    assert len(ff.__all__) <= 19 and "__version__" not in ff.__all__ and ff.__version__
    for gone in ("Block", "Blocks", "layers"):
        assert not hasattr(ff, gone), gone
    freezer = {n for n in dir(ff.Freezer) if not n.startswith("_")}
    assert freezer == {
        "plan", "summary", "report", "plot", "verify", "wrap", "update", "activate", "save_delta",
        "trainable_variables", "frozen_mask", "variable_state", "history", "of",
    }  # fmt: skip
    opt, inner = ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan()), keras.optimizers.SGD(0.1)
    own = {n for n in dir(opt) if not n.startswith("_")} - {n for n in dir(inner) if not n.startswith("_")}
    assert own == {"inner_optimizer", "plan", "strategy"}
    assert len(inspect_parameters(ff.select)) <= 12


def inspect_parameters(fn):
    import inspect

    return inspect.signature(fn).parameters


def test_help_of_every_command_imports_no_tensorflow():
    code = (
        "import sys\n"
        "from finefreeze._cli.commands import main\n"
        "for cmd in ([], ['finetune'], ['inspect'], ['verify'], ['delta'], ['delta', 'export'], ['delta', 'apply']):\n"
        "    try:\n"
        "        main([*cmd, '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (cmd, e.code)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print('HEAVY', heavy)\n"
    )
    proc = python(code, quiet_env=False)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert proc.stderr == ""


def saved_model(path):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    m = build_text_model()
    frz = ff.Freezer(m, ff.Plan.from_dict(DEFAULT_PLAN))
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-3)), loss="mse")
    m.save(path)
    return m


@pytest.mark.slow
def test_saved_files_load_with_import_finefreeze_alone(tmp_path):
    m = saved_model(tmp_path / "t.keras")
    np.save(tmp_path / "w.npy", m.get_layer("position_embedding").embeddings.numpy())
    for order in ("import finefreeze\nimport keras", "import keras\nimport finefreeze"):
        code = (
            f"{order}\nimport numpy as np\n"
            f"m = keras.models.load_model({str(tmp_path / 't.keras')!r})\n"
            "pos = m.get_layer('position_embedding')\n"
            f"assert np.array_equal(pos.embeddings.numpy(), np.load({str(tmp_path / 'w.npy')!r}))\n"
            "print(type(pos).__module__, type(m.optimizer).__name__)\n"
        )
        proc = python(code)
        assert proc.returncode == 0, (order, proc.stderr[-2000:])
        assert proc.stdout.split() == ["finefreeze._data.layers", "FreezingOptimizer"], proc.stdout


@pytest.mark.backends("jax", "torch", reason="TensorFlow may be missing only where Keras runs on another backend")
def test_graph_code_without_tensorflow_says_how_to_install_it():
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"ff\.tf1 .* needs TensorFlow: pip install 'finefreeze\[tensorflow\]'"):
            ff.tf1  # noqa: B018
    else:  # installed here: graph code works beside another backend
        assert ff.tf1.Freezer.__module__ == "finefreeze._freezer.graph"
