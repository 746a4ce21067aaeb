"""The summary table: every column filled, readable width on real architectures, full text in the report."""

import re

import keras
import numpy as np
import pytest

import finefreeze as ff
from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model


def table_rows(text):
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"─"}]
    return lines[rules[1] + 1 : rules[2]]


@pytest.mark.parametrize("variables", [True, False])
def test_every_column_of_every_row_is_filled(variables):
    frz = ff.Freezer(build_text_model(), ff.Plan.from_dict(DEFAULT_PLAN))
    rows = table_rows(frz.summary(variables=variables))
    assert len(rows) == (len(frz.report()["variables"]) if variables else 0) + len(frz.report()["layers"])
    for row in rows:
        cells = re.split(r"\s{2,}", row.strip())
        assert len(cells) == 8, row
    emb = next(r for r in rows if r.startswith("token_embedding"))
    assert "1 variable" in emb and emb.endswith("  1, 2")


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="a summary's layout, the same on every backend")
def test_densenet_summary_stays_readable_and_the_report_keeps_everything():
    model = keras.applications.DenseNet121(weights=None)
    long_rule = ff.freeze("re:conv5_block16_2_conv/kernel", where=lambda v: abs(v) < 0.01)
    plan = ff.Plan([ff.freeze("**"), ff.train("re:conv5_block1[0-6].*"), ff.train("**/predictions/**"), long_rule])
    frz = ff.Freezer(model, plan)
    rep = frz.report()
    for variables in (True, False):
        lines = frz.summary(variables=variables, detail=True).splitlines()
        assert max(map(len, lines)) <= 132, max(lines, key=len)
        for row in table_rows("\n".join(lines)):
            assert len(re.split(r"\s{2,}", row.strip())) == 8, row
    text = frz.summary(detail=True)
    assert "…" in text
    assert max(map(len, frz.summary().splitlines())) <= 132  # the grouped view, the default on a model this size
    frozen_line = next(line for line in text.splitlines() if line.startswith("Frozen as layers"))
    assert f"({len(rep['frozen_layers'])} layers; all in report()['frozen_layers'])" in frozen_line
    assert len(rep["frozen_layers"]) > 100 and repr(long_rule) in rep["plan"]


def test_the_state_column_names_the_wrapped_optimizer_on_every_path():
    w = keras.Variable(np.zeros((4, 4), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
    assert "state (Adam)" in frz.summary()  # before any wrap: what auto assumes
    frz.wrap(keras.optimizers.SGD(0.1))  # the wrapper dropped at once
    assert "SGD state" in frz.summary() and "Adam" not in frz.summary()
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
    f2 = ff.Freezer(m, ff.Plan([ff.freeze("**/d/bias")]))
    m.compile(optimizer=f2.wrap(keras.optimizers.AdamW()), loss="mse")
    keep = f2.wrap(keras.optimizers.Lion())  # wrapped last, but AdamW is what trains the model
    assert "AdamW state" in f2.summary() and keep is not None


def test_a_partial_variable_never_reads_as_all_frozen_or_all_trained():
    w = keras.Variable(np.zeros((100, 100), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w[0, 0]")]))
    assert "partial >99.9% frozen" in frz.summary()
    frz.update(ff.Plan([ff.freeze("w[0, 0]")]))
    assert "partial <0.1% frozen" in frz.summary()
    frz.update(ff.Plan([ff.freeze("w[:50]")]))
    assert "partial 50.0% frozen" in frz.summary()


def test_the_grouped_view_of_no_plan_says_there_are_no_rules():
    m = keras.Sequential([keras.Input((3,)), *(keras.layers.Dense(2, name=f"d{i}") for i in range(30))], name="m")
    text = ff.Freezer(m, ff.Plan([])).summary(detail=False)
    assert text.splitlines()[0] == "Freeze plan: no rules (every variable as Keras trains it)"
