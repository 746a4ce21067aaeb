"""The same plans, exactness and proof on JAX: the backend-neutral tests and a smoke run, in subprocesses.

Keras picks its backend once per process, so the TensorFlow suite runs the
JAX checks in child processes with ``KERAS_BACKEND=jax``.
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


@pytest.mark.slow
def test_public_features_end_to_end_on_jax_without_tensorflow(tmp_path):
    got = run_on("jax", str(ROOT / "tests" / "backend_smoke.py"), str(tmp_path), cwd=tmp_path)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    lines = got.stdout.strip().splitlines()
    assert lines[-1] == "OK: jax"
    assert "TensorFlow never imported" in lines


@pytest.mark.slow
def test_backend_neutral_suite_on_jax():
    got = run_on("jax", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests")
    tail = got.stdout[-3000:] + got.stderr[-2000:]
    assert got.returncode == 0, tail
    summary = got.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary


@pytest.mark.slow
def test_keras_distribution_on_two_jax_devices():
    got = run_on(
        "jax", str(ROOT / "tests" / "backend_distribution.py"), XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert got.stdout.strip().splitlines()[-1] == "OK"
