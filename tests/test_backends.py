"""What only a fresh interpreter shows: off TensorFlow, nothing imports TensorFlow; JAX over two host devices.

Each check starts one child process on the backend of this run (a process
is what is tested: which modules it imported, devices fixed at start-up).
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

from keras_backends import HIDE

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKEND = keras.backend.backend()


def run_on(backend: str, *args: str, cwd=ROOT, timeout=600, hide: bool | None = None, **env_vars: str):
    """``python *args`` on ``backend``; ``hide``: TensorFlow unimportable (None: as in this run)."""
    env = dict(
        os.environ,
        KERAS_BACKEND=backend,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    env.update(env_vars)
    if hide is not None:
        env.pop(HIDE, None)
        if hide:
            env[HIDE] = "1"
        else:  # the run's hiding sitecustomize stays off the child's path too: TensorFlow is importable there
            paths = env["PYTHONPATH"].split(os.pathsep)
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if pathlib.Path(p).name != "hide_tensorflow")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.backends("jax", "torch", reason="checks that TensorFlow is never imported off its backend")
def test_public_features_end_to_end_never_import_tensorflow(tmp_path):
    """Where TensorFlow is installed, nothing of finefreeze (fit, schedules, save/load, deltas) imports it."""
    got = run_on(BACKEND, str(ROOT / "tests" / "backend_smoke.py"), str(tmp_path), cwd=tmp_path, hide=False)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    lines = got.stdout.strip().splitlines()
    assert lines[-1] == f"OK: {BACKEND}"
    assert "TensorFlow never imported" in lines


@pytest.mark.slow
@pytest.mark.backends("jax", "torch", reason="checks that TensorFlow is never imported off its backend")
def test_no_selector_form_imports_tensorflow_where_it_is_installed():
    """Layer instances, variables and callables as selectors once asked TensorFlow's types (importing it on JAX)."""
    got = run_on(BACKEND, str(ROOT / "tests" / "backend_no_tensorflow.py"), hide=False)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == f"OK: {BACKEND}"


@pytest.mark.backends("jax", "torch", reason="the runs without TensorFlow are these backends'")
def test_the_hiding_switch_makes_tensorflow_unimportable():
    """What the runs without TensorFlow rely on: Keras sees none, and importing it fails."""
    code = (
        "import importlib.util, sys, keras_backends, keras; "
        "print(keras.src.utils.module_utils.tensorflow.available, importlib.util.find_spec('tensorflow'), "
        "'tensorflow' in sys.modules)"
    )
    got = run_on(BACKEND, "-c", code, hide=True)
    assert got.returncode == 0 and got.stdout.strip() == "False None False", got.stdout + got.stderr[-2000:]
    got = run_on(BACKEND, "-c", "import keras_backends, tensorflow", hide=True)
    assert got.returncode != 0 and "ModuleNotFoundError" in got.stderr, got.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.backends("jax", reason="keras.distribution over JAX's host devices")
def test_keras_distribution_on_two_jax_devices():
    """Two host devices exist only if XLA is told so before JAX starts: a child process."""
    got = run_on(
        "jax", str(ROOT / "tests" / "backend_distribution.py"), XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == "OK"


@pytest.mark.slow
@pytest.mark.backends("jax", reason="keras.distribution over JAX's host devices")
def test_model_parallel_on_eight_devices_replicates_nothing_for_sliced_and_sampled_gradients():
    """KerasHub's Gemma layout map on 8 host devices: exact, and XLA never copies a whole tensor to every device."""
    got = run_on(
        "jax",
        str(ROOT / "tests" / "backend_model_parallel.py"),
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        TF_CPP_MIN_LOG_LEVEL="1",  # XLA's warnings on (its logging obeys TensorFlow's variable)
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == "OK"
    replicated = [line for line in got.stderr.splitlines() if "Involuntary full rematerialization" in line]
    assert replicated == [], replicated[:3]
