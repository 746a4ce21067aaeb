"""Bad input: one exception type per kind, a message naming rule, path and
shape, and a model whose flags are exactly as before."""

import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from conftest import flags, mlp

K = "**/dense_0/kernel"
P = "mlp/dense_0/kernel"


def _raise(_):
    raise RuntimeError("boom")


# (id, callable building the plan and the Freezer, substrings the message must contain)
CASES = [
    (
        "nothing-selected",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze("encodr/**")])),
        ["rule 1 freeze('encodr/**') selects nothing", "Closest existing paths", "mlp/"],
    ),
    (
        "int-out-of-range",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[5]")])),
        ["rule 1", P, "(5, 8)", "5 not in [-5, 5)"],
    ),
    ("negative-out-of-range", lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[-6]")])), ["rule 1", P, "(5, 8)"]),
    (
        "slice-beyond-dim",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[:, 0:9]")])),
        ["rule 1", P, "slice stop 9 beyond dimension 8"],
    ),
    ("slice-start-beyond", lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[-7:]")])), ["rule 1", P, "slice start -7"]),
    (
        "too-many-indices",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[0, 0, 0]")])),
        ["rule 1", P, "3 indices", "(5, 8)"],
    ),
    ("list-out-of-range", lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K + "[[0, 7]]")])), ["rule 1", P, "7 not in"]),
    (
        "mask-wrong-shape",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, mask=np.ones((3, 3), bool))])),
        ["rule 1", P, "(3, 3)", "(5, 8)"],
    ),
    ("mask-float", lambda m: ff.freeze(K, mask=np.ones((5, 8))), [K, "float64", "bool"]),
    ("mask-int", lambda m: ff.freeze(K, mask=np.ones((5, 8), np.int32)), [K, "int32", "astype(bool)"]),
    (
        "where-float",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, where=lambda w: w * 2)])),
        ["rule 1", P, "float32", "(5, 8)", "bool"],
    ),
    (
        "where-wrong-shape",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, where=lambda w: np.ones((2, 2), bool))])),
        ["rule 1", P, "(2, 2)", "(5, 8)"],
    ),
    (
        "where-one-row",  # broadcasts to the kernel, but a predicate returns one bool per element
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, where=lambda w: w[0] > 0)])),
        ["rule 1", P, "where= returned shape (8,)", "(5, 8)", "mask="],
    ),
    (
        "where-raises",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, where=_raise)])),
        ["rule 1", P, "RuntimeError: boom"],
    ),
    ("where-not-callable", lambda m: ff.freeze(K, where=3), [K, "callable"]),
    (
        "indices-arity",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, indices=[(0,)])])),
        ["rule 1", P, "(0,)", "2 axes"],
    ),
    (
        "indices-out-of-range",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K, indices=[(5, 0)])])),
        ["rule 1", P, "(5, 0)", "axis 0"],
    ),
    ("indices-not-int", lambda m: ff.freeze(K, indices=[("a", 0)]), [K, "integer tuples"]),
    ("indices-a-float", lambda m: ff.freeze(K, indices=[(0.5, 0)]), [K, "integer tuples", "0.5"]),
    ("indices-a-digit-string", lambda m: ff.freeze(K, indices=[("1", 0)]), [K, "integer tuples", "'1'"]),
    ("indices-empty", lambda m: ff.freeze(K, indices=[]), [K, "empty"]),
    ("selector-type", lambda m: ff.freeze(42), ["unknown selector type int", "42"]),
    ("bad-regex", lambda m: ff.freeze("re:dense_[0-"), ["re:dense_[0-", "bad regular expression"]),
    ("empty-regex", lambda m: ff.freeze("re:"), ["'re:'", "empty regular expression"]),
    ("empty-glob", lambda m: ff.freeze(""), ["bad glob ''", "empty"]),
    ("glob-bracket", lambda m: ff.freeze("dense]kernel"), ["dense]kernel", "']' without '['"]),
    ("glob-triple-star", lambda m: ff.freeze("mlp/***"), ["mlp/***", "'***'"]),
    ("glob-leading-slash", lambda m: ff.freeze("/mlp/head"), ["/mlp/head", "empty path segment"]),
    ("index-unclosed", lambda m: ff.freeze("kernel[0:"), ["kernel[0:", "column 10"]),
    ("index-zero-step", lambda m: ff.freeze("kernel[::0]"), ["kernel[::0]", "step cannot be zero"]),
    (
        "nothing-to-train",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze("**")])),
        ["leaves nothing to train", "freeze('**')"],
    ),
    ("lr-scale-negative", lambda m: ff.train("**/head/**", lr_scale=-1), ["**/head/**", "lr_scale=-1"]),
    ("lr-scale-nan", lambda m: ff.train("**/head/**", lr_scale=float("nan")), ["**/head/**", "lr_scale=nan"]),
    ("plan-not-rule", lambda m: ff.Plan(["**"]), ["Plan entry 0", "'**'", "ff.freeze"]),
    (
        "unknown-strategy",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(K)]), strategy="fast"),
        ["unknown strategy 'fast'", "restore"],
    ),
    (
        "callable-raises",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze(lambda p, v: 1 / 0)])),
        ["ZeroDivisionError", "mlp/dense_0/kernel", "(5, 8)"],
    ),
    ("bad-target", lambda m: ff.Freezer("model.keras", ff.Plan([ff.freeze(K)])), ["cannot freeze a str"]),
    (
        "dict-two-actions",
        lambda m: ff.Plan.from_dict({"rules": [{"freeze": "**", "train": "x"}]}),
        ["rule 1", "exactly one of"],
    ),
    ("dict-rules-not-list", lambda m: ff.Plan.from_dict({"rules": "x"}), ["'rules' must be a list"]),
    (
        "dict-unknown-key",
        lambda m: ff.Plan.from_dict({"rules": [{"freeze": "**", "mask_": 1}]}),
        ["rule 1", "unknown keys ['mask_']"],
    ),
    ("dict-bad-selector", lambda m: ff.Plan.from_dict({"rules": [{"freeze": "k[1,"}]}), ["rule 1", "k[1,", "column"]),
    (
        "lr-scale-on-freeze",
        lambda m: ff.Plan.from_dict({"rules": [{"freeze": "**", "lr_scale": 2}]}),
        ["rule 1", "lr_scale belongs to train rules"],
    ),
    (
        "layer-class-unknown",
        lambda m: ff.Freezer(m, ff.Plan([ff.freeze({"layer_class": "Conv2D"})])),
        ["rule 1 freeze(Conv2D) selects nothing"],
    ),
]


def test_corpus_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("make, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(make, needles):
    model = mlp()
    before = flags(model)
    values = [v.numpy().copy() for v in weights_of(model)]
    with pytest.raises(ff.PlanError) as e:
        make(model)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in message:\n{msg}"
    assert "Traceback" not in msg
    assert flags(model) == before
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(values, weights_of(model)))


def test_failing_freezer_after_another_leaves_flags_as_they_were():
    model = mlp()
    ff.Freezer(model, ff.Plan([ff.freeze("**/head/**")]))
    before = flags(model)
    with pytest.raises(ff.PlanError):
        ff.Freezer(model, ff.Plan([ff.freeze("**/dense_0/**"), ff.freeze("nope")]))
    assert flags(model) == before


def test_plan_error_is_a_value_error():
    assert issubclass(ff.PlanError, ValueError)
