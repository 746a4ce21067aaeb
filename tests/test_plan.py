"""Plans are immutable, chainable, and round-trip through dicts and files."""

import keras
import numpy as np
import pytest

import finefreeze as ff


def example_plan():
    return ff.Plan(
        [
            ff.freeze("**"),
            ff.train("head/**", lr_scale=0.5),
            ff.train("token_embedding/embeddings[1000:, ::2]"),
            ff.freeze("re:.*bias"),
            ff.freeze("dense/kernel", indices=[(0, 0), (1, 1)]),
            ff.train("dense/kernel", mask=np.array([[True, False], [False, True]])),
            ff.freeze({"layer_class": "BatchNormalization"}),
        ],
        strict=False,
    )


def test_plan_is_immutable_and_chaining_returns_new_plans():
    p = ff.Plan([ff.freeze("**")])
    q = p.train("head/**")
    assert len(p) == 1 and len(q) == 2
    assert q.rules[0] is p.rules[0]
    with pytest.raises(AttributeError):
        p.strict = False
    assert repr(q) == "Plan([freeze('**'), train('head/**')])"


def test_repr_reads_like_the_user_line():
    assert repr(ff.train("emb/embeddings[1000:]", lr_scale=0.1)) == "train('emb/embeddings[1000:]', lr_scale=0.1)"
    assert repr(ff.freeze("k", indices=[(0, 1)])) == "freeze('k', indices=[[0, 1]])"


def test_dict_round_trip():
    p = example_plan()
    d = p.to_dict()
    assert d["strict"] is False
    assert d["rules"][1] == {"train": "head/**", "lr_scale": 0.5}
    assert ff.Plan.from_dict(d) == p


@pytest.mark.parametrize("ext", [".json", ".toml", ".yaml", ".yml"])
def test_file_round_trip(tmp_path, ext):
    p = example_plan()
    path = tmp_path / f"plan{ext}"
    p.save(path)
    q = ff.Plan.load(path)
    assert q == p
    assert q.to_dict() == p.to_dict()


@pytest.mark.parametrize(
    "ext, text, line",
    [
        (".json", '{"rules": [\n  {"freeze": "**"},\n  {"train": }\n]}', 3),
        (".toml", 'strict = true\n[[rules]]\nfreeze = "**"\ntrain = \n', 4),
        (".yaml", "rules:\n  - freeze: '**'\n  - train: [unclosed\n", 4),
    ],
)
def test_unparsable_file_names_file_and_line(tmp_path, ext, text, line):
    path = tmp_path / f"bad{ext}"
    path.write_text(text)
    with pytest.raises(ff.PlanError) as e:
        ff.Plan.load(path)
    assert f"{path}:{line}" in str(e.value)


def test_semantic_errors_in_files_name_the_rule(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"rules": [{"freeze": "**"}, {"freez": "x"}]}')
    with pytest.raises(ff.PlanError, match=r"p.json: rule 2: a rule has exactly one of"):
        ff.Plan.load(path)


def test_unwritable_rules_say_why():
    with pytest.raises(ff.PlanError, match="where= callable cannot be written"):
        ff.Plan([ff.freeze("x", where=lambda w: w == 0)]).to_dict()
    with pytest.raises(ff.PlanError, match="cannot be written to a plan file"):
        ff.Plan([ff.freeze(lambda p, v: True)]).to_dict()


def test_unknown_extension(tmp_path):
    with pytest.raises(ff.PlanError, match="unknown extension"):
        ff.Plan([ff.freeze("**")]).save(tmp_path / "p.txt")


@pytest.mark.slow
def test_import_does_not_load_optional_extras():
    import subprocess
    import sys

    code = "import sys, finefreeze; print('yaml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    # and it imports, plots aside, where neither extra is installed
    code = (
        "import sys; sys.modules['yaml'] = sys.modules['matplotlib'] = None; import finefreeze as ff; "
        "print(ff.callbacks.FreezeBoard.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "FreezeBoard"


def test_batchnorm_survives_every_plan_file_format(tmp_path):
    plan = ff.Plan([ff.freeze("**"), ff.train("head/**")], batchnorm="affine")
    for suffix in (".json", ".toml", ".yaml"):
        plan.save(tmp_path / f"p{suffix}")
        assert ff.Plan.load(tmp_path / f"p{suffix}") == plan, suffix


def test_two_integer_lists_in_one_index_are_refused_with_both_spellings():
    """numpy pairs ``[[0, 1], [0, 1]]`` into (0, 0), (1, 1); an outer product would take a 2 x 2 block."""
    with pytest.raises(ff.PlanError) as got:
        ff.train("**/d/kernel[[0, 1], [0, 1]]")
    msg = str(got.value)
    assert "numpy would select the 2 elements (0, 0), (1, 1)" in msg
    assert "ff.train('**/d/kernel', indices=[(0, 0), (1, 1)])" in msg
    assert "m[np.ix_([0, 1], [0, 1])] = True" in msg
    with pytest.raises(ff.PlanError, match="2 integer lists"):
        ff.freeze("w[[0, 2], 1, [3, 4, 5]]")
    # one list is an axis selection, as before; the spelled-out pairs select what numpy would
    w = keras.Variable(np.zeros((3, 3), "float32"), name="w")
    frz = ff.Freezer([w], ff.Plan([ff.freeze("w"), ff.train("w", indices=[(0, 0), (1, 1)]), ff.train("w[[2], :]")]))
    want = np.zeros((3, 3), bool)
    want[[0, 1], [0, 1]] = True
    want[2, :] = True
    assert np.array_equal(~frz.frozen_mask("w"), want)


def test_a_rules_mask_is_held_at_one_bit_per_element_and_reads_back_exactly():
    """A plan lives as long as its Freezer: a mask of random elements is kept packed, a copy of the one given."""
    rng = np.random.default_rng(0)
    given = rng.random((300, 70)) < 0.01
    rule = ff.train("dense/kernel", mask=given)
    assert rule.mask.nbytes == -(-given.size // 8)  # one bit per element, not one byte
    assert np.asarray(rule.mask).dtype == np.bool_
    assert np.array_equal(np.asarray(rule.mask), given)
    given[0, 0] = not given[0, 0]  # the caller's array changes: the rule's does not
    assert np.asarray(rule.mask)[0, 0] != given[0, 0]
    assert not np.asarray(rule.mask).flags.writeable
    assert repr(rule) == "train('dense/kernel', mask=<bool (300, 70)>)"
    back = ff.Plan.from_dict(ff.Plan([rule]).to_dict()).rules[0]  # the file's packed bits are the rule's
    assert np.array_equal(np.asarray(back.mask), np.asarray(rule.mask))
