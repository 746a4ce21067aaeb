"""benchmarks/mutations.py stays applicable: each mutation's text occurs exactly once in its source file."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutations", ROOT / "benchmarks" / "mutations.py")
mutations = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutations)


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=[m[0] for m in mutations.MUTATIONS])
def test_mutation_text_is_in_the_source_once(mutation):
    what, name, old, new, tests = mutation
    assert (mutations.SRC / name).read_text().count(old) == 1, f"update benchmarks/mutations.py: {what}"
    assert old != new
    run = tests.split(" ", 1)[1] if tests.startswith("KERAS_BACKEND=") else tests  # another backend's path
    assert (ROOT / run.split()[0].split("::")[0]).exists()  # a file, or a test in it
