"""Every script in examples/ runs and checks what it claims (each ends with an assert and "OK:").

Each runs in this process, as ``__main__``, on the backend of this run; an
example that imports TensorFlow at its top runs on TensorFlow only.
"""

import pathlib
import runpy

import keras
import pytest

from keras_backends import Markers

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


def _param(script: pathlib.Path):
    marks = []
    if Markers(script).imports_tensorflow():
        marks.append(pytest.mark.backends("tensorflow", reason="the example imports TensorFlow"))
    return pytest.param(script, id=script.stem, marks=marks)


def test_there_are_examples():
    assert len(EXAMPLES) >= 7


@pytest.mark.slow
@pytest.mark.parametrize("script", [_param(p) for p in EXAMPLES])
def test_example_runs_and_checks_itself(script, capsys):
    text = script.read_text()
    assert "assert " in text and '"""' in text.splitlines()[0], "an example explains itself and checks its claim"
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        keras.config.set_dtype_policy("float32")
        keras.backend.clear_session()
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("OK:"), out[-2000:]
