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
