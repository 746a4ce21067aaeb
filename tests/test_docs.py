"""The docs stay true: generated pages match their generators, links resolve, every public symbol is documented."""

import importlib.util
import pathlib
import re

import pytest

import finefreeze as ff

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def load(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / "gen" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.backends("tensorflow", reason="the page documents ff.tf1, graph code that imports TensorFlow")
def test_api_page_is_generated_from_the_docstrings():
    assert (DOCS / "api.md").read_text() == load("api").page(), "run: python docs/gen/api.py --write"


def test_every_public_symbol_is_in_the_api_page_and_documented():
    text = (DOCS / "api.md").read_text()
    names = [n for n in ff.__all__ if n != "__version__"]
    names += [f"callbacks.{n}" for n in ff.callbacks.__all__]
    for name in names:
        assert f"## `ff.{name}" in text or f"`ff.{name}`" in text, name


@pytest.mark.backends("tensorflow", reason="the page shows the messages of the default backend, TensorFlow")
def test_troubleshooting_page_shows_the_real_messages():
    got = load("troubleshooting").page()
    assert (DOCS / "troubleshooting.md").read_text() == got, "run: python docs/gen/troubleshooting.py --write"
    assert got.count("ff.PlanError:") >= 10


def test_links_in_readme_and_docs_resolve():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_readme_links_every_example():
    readme = (ROOT / "README.md").read_text()
    for script in (ROOT / "examples").glob("*.py"):
        assert f"examples/{script.name}" in readme, script.name


def test_readme_quickstart_runs():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Quickstart\s+```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    ns = {}
    exec(compile(code, "README quickstart", "exec"), ns)  # noqa: S102
    kernel = ns["model"].get_layer("backbone").kernel.path  # "sequential_<n>/..." in a long session
    assert ns["frz"].variable_state(kernel) == "partial"


NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}
#: helper scripts a test runs in a child process, and the backends of the test that runs them
RUN_BY = {"tests/backend_distribution.py": ("jax",), "tests/backend_model_parallel.py": ("jax",)}


def backends_of(ref: str) -> tuple[str, ...]:
    """The backends whose runs include the test (or file) ``ref`` names, from the markers in its file."""
    import ast

    from keras_backends import ALL, _file_backends, _is_backends_mark

    path, _, name = ref.partition("::")
    if path in RUN_BY:
        return RUN_BY[path]
    found = set(_file_backends(ROOT / path) or ALL)
    if name:
        tree = ast.parse((ROOT / path).read_text())
        (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        for mark in fn.decorator_list:
            if _is_backends_mark(mark):
                found &= {a.value for a in mark.args}
    return tuple(b for b in ALL if b in found)


def test_the_guarantees_name_existing_tests_and_the_backends_that_run_them():
    """Each promise's row names tests that exist, and the backends column is what their markers say."""
    text = (DOCS / "guarantees.md").read_text()
    exact = text[text.index("## What is exact") : text.index("## What is refused")]
    rows = [ln for ln in exact.splitlines() if ln.startswith("| ") and not ln.startswith("| promise")]
    assert len(rows) >= 20
    for row in rows:
        refs = ["::".join(filter(None, r)) for r in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", row)]
        assert refs, row
        said = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert said == backends_column(refs), (said, row[:80])


def backends_column(refs) -> str:
    """The backends column of a guarantee proved by ``refs``: where each runs, when they differ."""
    each = {ref: backends_of(ref) for ref in refs}  # raises on a test that does not exist
    words = lambda names: ", ".join(NAMES[b] for b in NAMES if b in names)  # noqa: E731
    if len(set(each.values())) == 1:
        return words(next(iter(each.values())))
    groups = {}
    for ref, names in each.items():
        groups.setdefault(names, []).append(f"`{ref.rsplit('/', 1)[-1]}`")
    return "; ".join(f"{words(names)}: {', '.join(refs)}" for names, refs in groups.items())
