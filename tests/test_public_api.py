"""The public namespace: flat, documented, with runnable examples."""

import inspect
import json
import subprocess
import sys

import finefreeze as ff


def test_all_is_flat_and_documented():
    for name in ff.__all__:
        obj = getattr(ff, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        doc = inspect.getdoc(obj)
        assert doc, f"{name} has no docstring"
        assert "Example" in doc and ">>>" in doc, f"{name} has no example"
        assert obj.__module__.startswith("finefreeze._"), f"{name} is defined outside a private module"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "finefreeze", *args], capture_output=True, text=True, timeout=300)


def test_cli_inspect_bundled_defaults():
    out = run_cli("inspect", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    emb = next(v for v in rep["variables"] if v["path"] == "token_embedding/embeddings")
    assert emb["state"] == "partial" and emb["trainable_elements"] == 32 * 32


def test_cli_inspect_bad_plan_exits_2_with_one_line(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text('{"rules": [{"freeze": "encodr/**"}]}')
    out = run_cli("inspect", "--plan", str(plan))
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("finefreeze")]
    assert len(lines) == 1 and "selects nothing" in lines[0]
    assert "Traceback" not in out.stderr
