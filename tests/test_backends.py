"""The same plans, exactness and proof on JAX and PyTorch: the backend-neutral tests and a smoke run, in subprocesses.

Keras picks its backend once per process, so the TensorFlow suite runs the
other backends' checks in child processes with ``KERAS_BACKEND=jax`` or
``torch``.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_on(backend: str, *args: str, cwd=ROOT, timeout=1200, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT / "src"), **env_vars)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


OTHER_BACKENDS = ["jax", "torch"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_public_features_end_to_end_never_import_tensorflow(backend, tmp_path):
    got = run_on(backend, str(ROOT / "tests" / "backend_smoke.py"), str(tmp_path), cwd=tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    lines = got.stdout.strip().splitlines()
    assert lines[-1] == f"OK: {backend}"
    assert "TensorFlow never imported" in lines


@pytest.mark.slow
@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_public_features_end_to_end_where_tensorflow_is_not_installed(backend, tmp_path):
    """Keras without TensorFlow takes other paths (saving, seeding): the same run with TensorFlow unimportable."""
    script = [str(ROOT / "tests" / "without_tensorflow.py"), str(ROOT / "tests" / "backend_smoke.py"), str(tmp_path)]
    got = run_on(backend, *script, cwd=tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == f"OK: {backend}"


@pytest.mark.parametrize("backend", OTHER_BACKENDS)
def test_no_selector_form_imports_tensorflow_where_it_is_installed(backend):
    """Layer instances, variables and callables as selectors once asked TensorFlow's types (importing it on JAX)."""
    got = run_on(backend, str(ROOT / "tests" / "backend_no_tensorflow.py"))
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == f"OK: {backend}"


def _failed_tests(junit: pathlib.Path) -> list[str]:
    """The ids of the failed and erroring tests of a pytest run's JUnit XML report."""
    import xml.etree.ElementTree as ET

    if not junit.exists():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            out.append(f"{case.get('classname')}::{case.get('name')}: {message}")
    return out


def test_the_import_hook_hides_tensorflow(tmp_path):
    """What the run above relies on: Keras sees no TensorFlow, and importing it fails."""
    (tmp_path / "imports_tf.py").write_text("import keras\nprint(keras.src.utils.module_utils.tensorflow.available)\n")
    got = run_on("jax", str(ROOT / "tests" / "without_tensorflow.py"), str(tmp_path / "imports_tf.py"))
    assert got.returncode == 0 and got.stdout.strip() == "False", got.stdout + got.stderr[-2000:]
    (tmp_path / "imports_tf.py").write_text("import tensorflow\n")
    got = run_on("jax", str(ROOT / "tests" / "without_tensorflow.py"), str(tmp_path / "imports_tf.py"))
    assert got.returncode != 0 and "ModuleNotFoundError: import of tensorflow halted" in got.stderr, got.stderr[-2000:]


#: JAX compiles every step: its run is cut in four, so the suite's two workers can share it
#: and no part comes near the 600 s a test may take.
HEAVY = ["tests/test_conformance.py", "tests/test_dynamic.py"]
SLICES = [
    "tests/test_slices.py",
    "tests/test_slices_rows.py",
    "tests/test_slices_auto.py",
    "tests/test_slices_sampled.py",
    "tests/test_board_backends.py",
    "tests/test_select_backends.py",
]
LONG_RUNS = [
    "tests/test_resume.py",
    "tests/test_faults.py",
    "tests/test_fresh_state.py",
    "tests/test_lora.py",
    "tests/test_reselect.py",
    "tests/test_real_models.py",
]
PARTS = {
    ("jax", "conformance and plan changes"): HEAVY,
    ("jax", "resuming, fresh state, LoRA and real models"): LONG_RUNS,
    ("jax", "slices, boards and selection"): SLICES,
    ("jax", "the rest"): ["tests", *(f"--ignore={m}" for m in HEAVY + LONG_RUNS + SLICES)],
    ("torch", "all"): ["tests"],
}


@pytest.mark.slow
@pytest.mark.parametrize("backend, part", list(PARTS))
def test_backend_neutral_suite_where_tensorflow_is_not_installed(backend, part, tmp_path):
    hidden = str(ROOT / "tests" / "without_tensorflow.py")
    junit = tmp_path / "junit.xml"
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "not one_backend", f"--junitxml={junit}"]
    got = run_on(backend, hidden, *args, *PARTS[backend, part])
    failed = _failed_tests(junit)
    tail = got.stdout[-3000:] + got.stderr[-2000:]
    assert got.returncode == 0 and not failed, f"{len(failed)} failed on {backend}:\n" + "\n".join(failed) + "\n" + tail
    summary = got.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary


@pytest.mark.slow
def test_keras_distribution_on_two_jax_devices():
    got = run_on(
        "jax", str(ROOT / "tests" / "backend_distribution.py"), XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == "OK"
