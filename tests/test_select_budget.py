"""``ff.select``'s budget (a fraction, a percent or a count) and its ``options``: the forms, the warning, the refusals."""

import inspect
import warnings

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from conftest import mlp, weights

N = 5 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4  # the candidates of WIDE(): every element Keras trains


def wide():
    return mlp(units=(64, 64, 4))


def chosen(model, plan):
    frz = ff.Freezer(model, plan)
    return {v.path: ~frz.frozen_mask(v.path) for v in weights_of(model)}


def count(masks):
    return sum(int(m.sum()) for m in masks.values())


def test_the_signature_is_the_parameters_a_user_sets():
    params = inspect.signature(ff.select).parameters
    assert list(params) == [
        "model", "data", "budget", "score", "include", "exclude", "loss", "structure", "spread",
        "batch_size", "batches", "options",
    ]  # fmt: skip
    assert [p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY][0] == "budget"


@pytest.mark.parametrize(
    "fraction, percent, k",
    [(0.05, "5%", 240), (0.005, "0.5%", 24), (0.003, " 0.3 % ", 14), (1.0, "100%", N), (0.0001, ".01%", 1)],
)
def test_a_fraction_its_percent_and_its_count_choose_the_same_elements(fraction, percent, k):
    m = wide()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ff.FreezeWarning)  # no warning of finefreeze's for any of them
        a = chosen(m, ff.select(m, budget=fraction, score="random"))
        b = chosen(m, ff.select(m, budget=percent, score="random"))
    assert count(a) == k == max(1, int(np.floor(fraction * N + 0.5)))
    for p in a:
        assert np.array_equal(a[p], b[p]), p
    if k > 100:
        c = chosen(m, ff.select(m, budget=k, score="random"))
        assert all(np.array_equal(a[p], c[p]) for p in a)


def test_numpy_numbers_are_counts_and_fractions_like_python_ones():
    m = wide()
    assert count(chosen(m, ff.select(m, budget=np.int64(300), score="random"))) == 300
    assert count(chosen(m, ff.select(m, budget=np.float32(0.05), score="random"))) == 240


@pytest.mark.parametrize("budget, percent", [(1, 'budget=0.01 or budget="1%"'), (100, 'budget=1.0 or budget="100%"')])
def test_a_count_that_looks_like_a_percent_counts_elements_and_says_how_to_write_a_percent(budget, percent):
    m = wide()
    with pytest.warns(ff.FreezeWarning) as said:
        plan = ff.select(m, budget=budget, score="random")
    assert count(chosen(m, plan)) == budget
    said = [w for w in said if issubclass(w.category, ff.FreezeWarning)]  # a backend may add its own
    assert len(said) == 1
    message = str(said[0].message)
    assert f"budget={budget} is a count: it selects {budget} of the {N:,} candidate elements" in message
    assert f"For {budget} % of them write {percent}" in message
    assert said[0].filename == __file__  # the line that called select


def test_a_count_above_100_is_said_nothing_about():
    m = wide()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ff.FreezeWarning)
        assert count(chosen(m, ff.select(m, budget=101, score="random"))) == 101


RULE = "a budget is a fraction of the candidate elements"


@pytest.mark.parametrize(
    "budget, match",
    [
        (0, "budget=0 selects nothing; " + RULE),
        (-3, "budget=-3 selects nothing; " + RULE),
        (1.5, r"budget=1.5 is not a fraction in \(0, 1\]; " + RULE),
        (5.0, 'For 5 % write budget=0.05 or budget="5%"; for a count, an int'),
        (0.0, r"budget=0.0 is not a fraction in \(0, 1\]"),
        (float("nan"), r"budget=nan is not a fraction in \(0, 1\]"),
        (True, "budget=True is a bool; " + RULE),
        (np.bool_(False), "is a bool; " + RULE),
        ("1", r"budget='1' is not a percent in \(0, 100\] such as \"1%\"; " + RULE),
        ("abc", "budget='abc' is not a percent"),
        ("0%", "budget='0%' is not a percent"),
        ("101%", "budget='101%' is not a percent"),
        ("-1%", "budget='-1%' is not a percent"),
        ("1%%", "budget='1%%' is not a percent"),
        (None, r"budget=None \(NoneType\); " + RULE),
        ([0.1], r"budget=\[0.1\] \(list\); " + RULE),
        (N + 1, f"budget={N + 1} elements, but {N:,} elements can be chosen"),
    ],
)
def test_a_bad_budget_is_a_plan_error_that_states_the_rule_and_changes_nothing(budget, match):
    m = wide()
    before = weights(m)
    with pytest.raises(ff.PlanError, match=match):
        ff.select(m, budget=budget, score="random")
    after = weights(m)
    assert all(np.array_equal(before[p], after[p]) for p in before)


@pytest.mark.slow
def test_options_default_to_what_they_say():
    m = wide()
    x, y = np.random.default_rng(0).normal(size=(16, 5)), np.random.default_rng(1).integers(0, 4, 16)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    explicit = {"largest": True, "microbatch": "auto", "per_example": "auto", "epochs": 1, "seed": 0, "verbose": 0}
    for score in ("random", "magnitude", "fisher"):
        data = (x, y) if score == "fisher" else None
        a = ff.select(m, data, budget=0.01, score=score, loss=loss, options={"verbose": 0})
        b = ff.select(m, data, budget=0.01, score=score, loss=loss, options={**explicit, "optimizer": None})
        assert [r.to_dict() for r in a.rules] == [r.to_dict() for r in b.rules], score
    assert ff.select(m, budget=0.01, score="random") == ff.select(m, budget=0.01, score="random", options={})


VALID = "The valid keys are largest, microbatch, per_example, epochs, optimizer, seed, verbose"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"seeds": 1}, "options has an unknown key 'seeds'; the valid keys are largest, microbatch, per_example"),
        ({"batch_size": 8}, "unknown key 'batch_size'"),  # an argument of its own, not an option
        ({"largest": "yes"}, r"options\['largest'\] must be True or False; got 'yes' \(str\). " + VALID),
        ({"largest": 1}, r"options\['largest'\] must be True or False"),
        ({"microbatch": 0}, r"options\['microbatch'\] must be an int >= 1 or \"auto\""),
        ({"microbatch": 2.0}, r"options\['microbatch'\] must be an int >= 1"),
        ({"per_example": "pfor"}, r"options\['per_example'\] must be 'auto', 'vectorized' or 'loop'"),
        ({"epochs": 0}, r"options\['epochs'\] must be an int >= 1"),
        ({"epochs": True}, r"options\['epochs'\] must be an int >= 1"),
        ({"optimizer": "adam"}, r"options\['optimizer'\] must be None or a Keras optimizer; got 'adam'"),
        ({"seed": -1}, r"options\['seed'\] must be an int >= 0"),
        ({"seed": "0"}, r"options\['seed'\] must be an int >= 0"),
        ({"verbose": 3}, r"options\['verbose'\] must be 0, 1 or 2"),
        ({"verbose": "auto"}, r"options\['verbose'\] must be 0, 1 or 2"),
        ([("seed", 1)], "options must be a dict of some of largest, microbatch"),
    ],
)
def test_a_bad_option_is_a_plan_error_that_names_it_lists_the_valid_keys_and_changes_nothing(options, match):
    m = wide()
    x, y = np.ones((8, 5), "float32"), np.zeros(8, "int32")
    before = weights(m)
    with pytest.raises(ff.PlanError, match=match) as e:
        ff.select(m, (x, y), budget=0.01, score="delta", loss="sparse_categorical_crossentropy", options=options)
    assert "largest, microbatch, per_example, epochs, optimizer, seed, verbose" in str(e.value)
    after = weights(m)
    assert all(np.array_equal(before[p], after[p]) for p in before)  # delta's training never began


def test_options_take_numpy_values():
    m = wide()
    a = ff.select(m, budget=0.01, score="random", options={"seed": np.int64(3), "largest": np.bool_(True)})
    assert a == ff.select(m, budget=0.01, score="random", options={"seed": 3})


@pytest.mark.slow
def test_the_command_line_takes_a_percent_and_says_a_small_count_in_one_line(tmp_path, capsys):
    from finefreeze._cli.selectfile import select_to_file

    percent = select_to_file(None, None, score="magnitude", budget="0.5%", out=str(tmp_path / "p"))
    fraction = select_to_file(None, None, score="magnitude", budget="0.005", out=str(tmp_path / "f"))
    assert ff.Plan.load(percent) == ff.Plan.load(fraction)
    assert capsys.readouterr().err == ""
    select_to_file(None, None, score="magnitude", budget="5", out=str(tmp_path / "c"))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("finefreeze finetune: warning: select: budget=5 is a count"), err
