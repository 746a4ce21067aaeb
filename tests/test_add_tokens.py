"""``ff.add_tokens``: new tokens for a KerasHub causal LM, every pretrained value bit for bit, on every backend.

The tasks are ``causal_lms``' tiny Gemma (tied embedding) and Llama (untied:
``embeddings`` and ``reverse_embeddings``) with a SentencePiece tokenizer
trained here. Values are compared with ``np.array_equal``, never a tolerance.
"""

import functools

import keras
import keras_hub  # in the test extra; a missing install fails here, it does not skip
import ml_dtypes
import numpy as np
import pytest

import causal_lms
import finefreeze as ff
from causal_lms import PROMPT, SEQ

NEW = ["<tool>", "</tool>"]
TABLE, REVERSE = "token_embedding/embeddings", "token_embedding/reverse_embeddings"
TEXT = "the cat <tool> sat </tool> on the mat"
FAMILIES = ["gemma", "llama"]


def values(model) -> dict[str, np.ndarray]:
    return {v.path: np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in model.weights}


def ids(tokenizer, text) -> list[int]:
    return [int(i) for i in keras.ops.convert_to_numpy(tokenizer(text))]


@functools.cache
def grown(family):
    """``(task, its values before, the new task)``: built once per family, read by the tests that change nothing."""
    lm = causal_lms.task(family)
    before = values(lm)
    return lm, before, ff.add_tokens(lm, NEW)


def state(lm):
    """What a failed ``add_tokens`` must leave as it was: values, vocabulary sizes, the tokenizer's proto."""
    tokenizer = lm.preprocessor.tokenizer if lm.preprocessor is not None else None
    return values(lm), lm.backbone.vocabulary_size, tokenizer and (tokenizer.vocabulary_size(), tokenizer.proto)


def assert_same_state(a, b):
    assert a[0].keys() == b[0].keys() and all(np.array_equal(a[0][p], b[0][p]) for p in a[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_rows_and_every_other_weight_are_bit_identical(family):
    lm, before, new = grown(family)
    old = lm.backbone.vocabulary_size
    after = values(new)
    assert type(new) is type(lm) and new is not lm and new.backbone.vocabulary_size == old + len(NEW)
    tables = {TABLE: 0, REVERSE: 1} if family == "llama" else {TABLE: 0}
    assert set(tables) == {p for p in after if p.startswith("token_embedding/")}
    assert after.keys() == before.keys()
    for path, value in before.items():
        if path not in tables:
            assert value.dtype == after[path].dtype and np.array_equal(after[path], value), path
            continue
        axis = tables[path]
        kept, added = np.split(after[path], [old], axis=axis)
        assert np.array_equal(kept, value), path
        mean = np.mean(value, axis=axis, dtype=np.float64, keepdims=True).astype(value.dtype)
        assert np.array_equal(added, np.repeat(mean, len(NEW), axis=axis)), path
    now = values(lm)  # the task given is left as it was
    assert lm.backbone.vocabulary_size == old and all(np.array_equal(now[p], before[p]) for p in before)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_new_token_encodes_to_one_new_id_in_order_and_the_old_tokenizer_is_unchanged(family):
    lm, _, new = grown(family)
    old, tokenizer, was = lm.backbone.vocabulary_size, new.preprocessor.tokenizer, lm.preprocessor.tokenizer
    assert type(tokenizer) is type(was) and tokenizer.vocabulary_size() == old + len(NEW)
    assert [tokenizer.token_to_id(t) for t in NEW] == [old, old + 1]
    got = ids(tokenizer, TEXT)
    assert [i for i in got if i >= old] == [old, old + 1]
    assert tokenizer.detokenize(got) == TEXT
    assert ids(tokenizer, "the cat sat") == ids(was, "the cat sat")  # old pieces keep their ids
    assert was.vocabulary_size() == old and was.token_to_id("<tool>") == was.token_to_id("<unk>")
    assert max(ids(was, TEXT)) < old
    pre, was_pre = new.preprocessor, lm.preprocessor
    assert type(pre) is type(was_pre) and pre.sequence_length == SEQ
    assert {k: v for k, v in pre.get_config().items() if k != "tokenizer"} == {
        k: v for k, v in was_pre.get_config().items() if k != "tokenizer"
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_runs_on_the_new_task(family):
    _, _, new = grown(family)
    new.compile(sampler="greedy")
    text = new.generate(PROMPT + " <tool>", max_length=SEQ)
    assert isinstance(text, str) and text.startswith(PROMPT + " <tool>")


@pytest.mark.parametrize("family", FAMILIES)
def test_init_zeros_and_an_array(family):
    lm = causal_lms.task(family)
    old, hidden = lm.backbone.vocabulary_size, lm.backbone.hidden_dim
    zeros = values(ff.add_tokens(lm, NEW, init="zeros"))
    assert np.array_equal(zeros[TABLE][old:], np.zeros((2, hidden), "float32"))
    rows = np.random.default_rng(0).normal(size=(2, hidden))
    given = values(ff.add_tokens(lm, NEW, init=rows))
    assert np.array_equal(given[TABLE][old:], rows.astype("float32"))
    if family == "llama":  # the untied output table: zeros, and the array's transpose
        assert np.array_equal(zeros[REVERSE][:, old:], np.zeros((hidden, 2), "float32"))
        assert np.array_equal(given[REVERSE][:, old:], rows.T.astype("float32"))
    with pytest.raises(ff.PlanError, match=rf"shape \(3, {hidden}\).*need \(2, {hidden}\)"):
        ff.add_tokens(lm, NEW, init=np.zeros((3, hidden)))
    with pytest.raises(ff.PlanError, match="init='normal' is not one of"):
        ff.add_tokens(lm, NEW, init="normal")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_plan_trains_only_the_new_rows(family):
    lm = ff.add_tokens(causal_lms.task(family), NEW)
    old = lm.backbone.vocabulary_size - len(NEW)
    before = values(lm)  # the task's own weights (a Freezer may add stand-ins)
    rules = [ff.freeze("**"), ff.train(f"{TABLE}[{old}:]")]
    if family == "llama":
        rules.append(ff.train(f"{REVERSE}[:, {old}:]"))
    frz = ff.Freezer(lm, ff.Plan(rules))
    lm.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), sampler="greedy")
    lm.fit(
        [f"{w} <tool> sat </tool> on the mat" for w in ("the cat", "a dog", "we", "she")] * 2,
        batch_size=4,
        epochs=1,
        shuffle=False,
    )
    after = values(lm)
    for path, value in before.items():
        if path in (TABLE, REVERSE):
            axis = 0 if path == TABLE else 1
            (kept, added), (was_kept, was_added) = np.split(after[path], [old], axis), np.split(value, [old], axis)
            assert np.array_equal(kept, was_kept), path
            assert not np.array_equal(added, was_added), path
        else:
            assert np.array_equal(after[path], value), path
    frz.verify()


def test_a_task_without_preprocessor_grows_by_a_number_of_rows():
    lm = causal_lms.task("gemma", preprocessor=False)
    before = values(lm)
    new = ff.add_tokens(lm, 3)
    assert new.preprocessor is None and new.backbone.vocabulary_size == lm.backbone.vocabulary_size + 3
    assert np.array_equal(values(new)[TABLE][:-3], before[TABLE])
    for bad in (NEW, 0, True):
        with pytest.raises(ff.PlanError, match="no preprocessor, so no tokenizer"):
            ff.add_tokens(lm, bad)
    assert_same_state(state(lm), (before, lm.backbone.vocabulary_size, None))


def test_a_bfloat16_table_keeps_its_rows_bit_for_bit():
    keras.config.set_dtype_policy("bfloat16")  # the suite's fixture sets float32 back
    lm = causal_lms.task("gemma", preprocessor=False)
    assert lm.backbone.token_embedding.embeddings.dtype == "bfloat16"
    before = values(lm)[TABLE]
    after = values(ff.add_tokens(lm, 2))[TABLE]
    assert np.array_equal(after[:-2], before)
    mean = np.mean(before, axis=0, dtype=np.float64).astype(ml_dtypes.bfloat16).astype(before.dtype)
    assert np.array_equal(after[-2:], np.stack([mean, mean]))


@pytest.mark.parametrize(
    "tokens, init, match",
    [
        (["<tool>", "<pad>"], "mean", r"'<pad>' is already in the vocabulary, with id 0"),
        ([], "mean", "tokens is empty"),
        (["<tool>", 7], "mean", r"tokens\[1\] is 7; every token must be a non-empty string"),
        (["<tool>", ""], "mean", r"tokens\[1\] is ''"),
        (["<tool>", "</tool>", "<tool>"], "mean", r"'<tool>' is in tokens twice \(at 0 and 2\)"),
        ("<tool>", "mean", r"must be a list of strings.*add_tokens\(task, \['<tool>'\]\)"),
        (["<to ol>"], "mean", r"would encode '<to ol>' as .*not as one piece"),
        (["<tool>"], "normal", "init='normal' is not one of"),
        (2, "mean", "received tokens=2, but the task has a tokenizer: pass the new tokens as strings"),
    ],
)
def test_a_refused_call_raises_plan_error_and_leaves_the_task_as_it_was(tokens, init, match):
    lm, before, _ = grown("gemma")
    was = state(lm)
    with pytest.raises(ff.PlanError, match=match):
        ff.add_tokens(lm, tokens, init=init)
    assert_same_state(state(lm), was)
    assert all(np.array_equal(was[0][p], before[p]) for p in before)


def test_a_model_that_is_not_a_kerashub_task_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Embedding(5, 2, name="token_embedding")])
    before = values(model)
    with pytest.raises(ff.PlanError, match="received a Sequential, not a KerasHub task"):
        ff.add_tokens(model, NEW)
    assert all(np.array_equal(before[p], v) for p, v in values(model).items())
    backbone = causal_lms.task("gemma").backbone  # a backbone is not a task either
    with pytest.raises(ff.PlanError, match="received a GemmaBackbone, not a KerasHub task"):
        ff.add_tokens(backbone, NEW)


def gpt2(vocabulary):
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=["Ġ a", "a b", "Ġa b"])
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary), num_layers=1, num_heads=1, hidden_dim=4, intermediate_dim=8,
        max_sequence_length=SEQ,
    )  # fmt: skip
    return keras_hub.models.GPT2CausalLM(backbone, keras_hub.models.GPT2CausalLMPreprocessor(tokenizer, SEQ))


def test_a_byte_pair_tokenizer_gets_its_new_tokens_unsplittable():
    vocabulary = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4, "Ġa": 5, "Ġab": 6, "<": 7, ">": 8, "x": 9}
    lm = gpt2(vocabulary)
    before = values(lm)
    new = ff.add_tokens(lm, ["<x>"], init="zeros")
    tokenizer, was = new.preprocessor.tokenizer, lm.preprocessor.tokenizer
    assert tokenizer.token_to_id("<x>") == 10 and ids(tokenizer, "ab<x> ab") == [3, 10, 6]
    assert ids(was, "ab<x> ab") == [3, 7, 9, 8, 6] and was.vocabulary_size() == 10
    after = values(new)
    assert np.array_equal(after[TABLE][:10], before[TABLE]) and not after[TABLE][10:].any()
    assert all(np.array_equal(after[p], before[p]) for p in before if p != TABLE)
    with pytest.raises(ff.PlanError, match="'ab' is already in the vocabulary, with id 3"):
        ff.add_tokens(lm, ["ab"])
