"""Fractions in rules: ``rows=`` / ``columns=`` / ``heads=`` pick the first fraction of each matched variable's slices.

The axis of each word per layer kind is docs/selectors.md's table; these
tests pin it on real layers (``Dense``, ``Embedding``, Keras'
``MultiHeadAttention`` and KerasHub's Gemma and Llama attention kernels).
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of


def trained(frz, path):
    return ~frz.frozen_mask(path)


def first(n, k, shape, axis):
    want = np.zeros(shape, bool)
    index = [slice(None)] * len(shape)
    index[axis] = slice(0, k)
    want[tuple(index)] = True
    assert n == shape[axis]
    return want


def mlp():
    inp = keras.Input((10,))
    return keras.Model(inp, keras.layers.Dense(3, name="head")(keras.layers.Dense(200, name="a")(inp)))


@pytest.mark.parametrize(
    "value, k",
    [(0.01, 2), ("1%", 2), (" 0.5 % ", 1), (0.0001, 1), (0.5, 100), ("100%", 200), (1.0, 200), (0.0125, 3)],
)
def test_columns_of_a_dense_kernel_are_its_output_units_rounded_half_up_at_least_one(value, k):
    m = mlp()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("a/kernel", columns=value)]))
    assert np.array_equal(trained(frz, "a/kernel"), first(200, k, (10, 200), 1))


def test_rows_of_a_dense_kernel_are_its_inputs_and_rows_with_columns_is_their_block():
    m = mlp()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("a/kernel", rows="30%")]))
    assert np.array_equal(trained(frz, "a/kernel"), first(10, 3, (10, 200), 0))
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("a/kernel", rows=0.3, columns=0.01)]))
    assert np.array_equal(trained(frz, "a/kernel"), first(10, 3, (10, 200), 0) & first(200, 2, (10, 200), 1))


def test_a_fraction_applies_to_each_matched_variable_by_its_own_size_and_to_a_bias_along_its_axis():
    m = mlp()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**", columns=0.1)]))
    assert np.array_equal(trained(frz, "a/kernel"), first(200, 20, (10, 200), 1))
    assert np.array_equal(trained(frz, "head/kernel"), first(3, 1, (200, 3), 1))  # 0.3 -> at least one
    assert np.array_equal(trained(frz, "a/bias"), first(200, 20, (200,), 0))
    assert np.array_equal(trained(frz, "head/bias"), first(3, 1, (3,), 0))


def test_a_fraction_combines_with_an_index_suffix_and_freeze_rules_take_it_too():
    m = mlp()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("a/kernel[5:]", columns=0.5)]))
    assert np.array_equal(trained(frz, "a/kernel"), first(200, 100, (10, 200), 1) & (np.arange(10) >= 5)[:, None])
    frz = ff.Freezer(m, ff.Plan([ff.freeze("a/kernel", columns=0.25)]))
    assert np.array_equal(frz.frozen_mask("a/kernel"), first(200, 50, (10, 200), 1))


def test_an_embedding_table_rows_are_tokens_and_columns_features():
    inp = keras.Input((4,), dtype="int32")
    m = keras.Model(inp, keras.layers.Embedding(50, 8, name="emb")(inp))
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("emb/embeddings", rows="10%")]))
    assert np.array_equal(trained(frz, "emb/embeddings"), first(50, 5, (50, 8), 0))
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("emb/embeddings", columns=0.25)]))
    assert np.array_equal(trained(frz, "emb/embeddings"), first(8, 2, (50, 8), 1))


def test_heads_of_keras_multi_head_attention_kernels():
    q = keras.Input((5, 16))
    mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="mha")
    m = keras.Model(q, mha(q, q))
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("mha/**/kernel", heads=0.25)]))
    for part in ("query", "key", "value"):  # (model, heads, head_dim)
        assert np.array_equal(trained(frz, f"mha/{part}/kernel"), first(4, 1, (16, 4, 8), 1)), part
    assert np.array_equal(trained(frz, "mha/attention_output/kernel"), first(4, 1, (4, 8, 16), 0))  # (heads, hd, m)


def test_heads_columns_and_rows_of_gemma_and_llama_attention_kernels():
    from causal_lms import task

    gemma, llama = task("gemma", preprocessor=False), task("llama", preprocessor=False)
    plan = ff.Plan([ff.freeze("**"), ff.train("**/query/kernel", heads=0.5), ff.train("**/value/kernel", columns=0.5)])
    g, ll = ff.Freezer(gemma, plan), ff.Freezer(llama, plan)
    # Gemma's q/k/v kernels are (heads, model, head_dim); Llama's (model, heads, head_dim)
    assert np.array_equal(trained(g, "decoder_block_0/attention/query/kernel"), first(2, 1, (2, 16, 8), 0))
    assert np.array_equal(trained(ll, "transformer_layer_0/self_attention/query/kernel"), first(2, 1, (16, 2, 8), 1))
    assert np.array_equal(trained(g, "decoder_block_0/attention/value/kernel"), first(8, 4, (1, 16, 8), 2))
    plan = ff.Plan([ff.freeze("**"), ff.train("**/attention_output/kernel", heads=0.5, columns=0.5)])
    g, ll = ff.Freezer(gemma, plan), ff.Freezer(llama, plan)
    want = first(2, 1, (2, 8, 16), 0) & first(16, 8, (2, 8, 16), 2)
    assert np.array_equal(trained(g, "decoder_block_0/attention/attention_output/kernel"), want)
    assert np.array_equal(trained(ll, "transformer_layer_0/self_attention/attention_output/kernel"), want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(columns=0), r"columns=0\).*a float in \(0, 1\]"),
        (dict(columns=1.5), r"a float in \(0, 1\]"),
        (dict(columns=5.0), r'For 5 % write columns="5%"'),
        (dict(rows=2), r"not a count.*'\[:2\]'"),
        (dict(heads=True), "not a bool"),
        (dict(columns="0%"), r"not a percent in \(0, 100\]"),
        (dict(columns="ten%"), "not a percent"),
    ],
)
def test_a_bad_fraction_is_a_plan_error_that_states_the_rule(kwargs, match):
    with pytest.raises(ff.PlanError, match=match):
        ff.train("a/kernel", **kwargs)


def test_heads_of_a_variable_without_a_heads_axis_is_a_plan_error_and_changes_nothing():
    m = mlp()
    before = [np.array(keras.ops.convert_to_numpy(w)) for w in weights_of(m)]
    with pytest.raises(ff.PlanError, match=r"a/kernel.*\(10, 200\).*heads= applies to the three-axis kernels.*Dense"):
        ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("a/kernel", heads=0.5)]))
    assert all(np.array_equal(np.array(keras.ops.convert_to_numpy(w)), b) for w, b in zip(weights_of(m), before))
    assert all(w.trainable for w in weights_of(m))


def test_fractions_round_trip_through_plan_files(tmp_path):
    plan = ff.Plan([ff.freeze("**"), ff.train("**/kernel", columns="1%", rows=0.5), ff.freeze("a/bias", heads=1.0)])
    assert repr(plan.rules[1]) == "train('**/kernel', rows=0.5, columns=0.01)"
    for suffix in (".json", ".toml"):
        plan.save(tmp_path / f"p{suffix}")
        assert ff.Plan.load(tmp_path / f"p{suffix}") == plan
    assert ff.Plan.from_dict({"rules": [{"train": "a/kernel", "columns": "1%"}]}).rules[0].slices == (
        ("columns", 0.01),
    )


def test_fractions_of_every_attention_kernel_train_exactly_through_the_task_fit():
    """A KerasHub Gemma task through its own fit: the first 25 % of the columns train, the rest is bit-identical."""
    from causal_lms import task, token_batch

    lm = task("gemma", preprocessor=False)
    frz = ff.Freezer(lm, ff.Plan([ff.freeze("**"), ff.train("**/attention/**/kernel", columns="25%")]))
    lm.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)))
    x, y, w = token_batch(lm)
    before = {v.path: np.array(keras.ops.convert_to_numpy(v)) for v in weights_of(lm)}
    lm.fit(x, y, sample_weight=w, batch_size=4, epochs=2, verbose=0)
    frz.verify()
    for v in weights_of(lm):
        now, was = np.array(keras.ops.convert_to_numpy(v)), before[v.path]
        frozen = frz.frozen_mask(v.path)
        assert np.array_equal(now[frozen], was[frozen]), v.path
        if "attention" in v.path and v.path.endswith("kernel"):
            assert (now[~frozen] != was[~frozen]).all(), v.path
            assert (~frozen).sum() == v.shape[0] * v.shape[1] * (2 if v.shape[2] == 8 else 4)
