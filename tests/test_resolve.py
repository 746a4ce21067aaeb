"""Resolution of plans against every kind of target."""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, weights_of
from conftest import flags, functional, mlp, nested, subclassed, transformer


def paths(vs):
    return [v.path if hasattr(v, "path") else v.name.split(":")[0] for v in vs]


def test_sequential_last_rule_wins_and_flags_follow():
    m = mlp()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("**/head/**"), ff.train("**/dense_0/kernel[0]")]))
    assert paths(frz.trainable_variables) == ["mlp/dense_0/kernel", "mlp/head/kernel", "mlp/head/bias"]
    assert frz.variable_state("mlp/dense_0/kernel") == "partial"
    assert frz.variable_state("mlp/dense_1/bias") == "frozen"
    mask = frz.frozen_mask("mlp/dense_0/kernel")
    assert mask.shape == (5, 8) and not mask[0].any() and mask[1:].all()
    # fully frozen variables leave training the Keras way; partial ones stay trainable
    assert paths(m.trainable_variables) == ["mlp/dense_0/kernel", "mlp/head/kernel", "mlp/head/bias"]


def test_classic_train_only_diagonal_of_2x2():
    x = keras.Variable(np.arange(4, dtype="float32").reshape(2, 2), name="x")
    frz = ff.Freezer([x], ff.Plan([ff.freeze("x"), ff.train("x", indices=[(0, 0), (1, 1)])]))
    assert np.array_equal(frz.frozen_mask("x"), np.array([[False, True], [True, False]]))
    frz2 = ff.Freezer([x], ff.Plan([ff.freeze("x"), ff.train("x", mask=np.eye(2, dtype=bool))]))
    assert np.array_equal(frz2.frozen_mask("x"), frz.frozen_mask("x"))


def test_classic_freeze_first_1000_embedding_rows():
    m = transformer(vocab=1200)
    frz = ff.Freezer(m, ff.Plan([ff.freeze("token_embedding/embeddings[:1000]")]))
    mask = frz.frozen_mask("token_embedding/embeddings")
    assert mask.shape == (1200, 16)
    assert mask[:1000].all() and not mask[1000:].any()
    assert frz.variable_state("head/kernel") == "trainable"


def test_functional_with_shared_layer():
    m = functional()
    frz = ff.Freezer(m, ff.Plan([ff.freeze(m.get_layer("shared"))]))
    assert frz.variable_state("shared/kernel") == "frozen"
    assert frz.variable_state("pre/kernel") == "trainable"
    # shared variables appear once
    assert len(frz.report()["variables"]) == len(weights_of(m))


def test_subclassed_and_layer_class_and_regex():
    m = subclassed()
    frz = ff.Freezer(m, ff.Plan([ff.freeze(Block := type(m.block_a)), ff.train("re:.*block_b/.*/bias")]))
    assert Block.__name__ == "Block"
    states = {s["path"]: s["state"] for s in frz.report()["variables"]}
    assert states["sub/block_a/inner/kernel"] == "frozen"
    assert states["sub/block_b/outer/bias"] == "trainable"
    assert states["sub/block_b/outer/kernel"] == "frozen"
    assert states["sub/head/kernel"] == "trainable"


def test_nested_model_paths_and_glob_forms():
    m = nested()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("backbone/**")]))
    assert paths(frz.trainable_variables) == ["head/kernel", "head/bias"]
    # '**/dense_0/kernel' reaches into the nested Sequential; '*' stays in a segment
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/dense_0/kernel"), ff.freeze("*/bias")]))
    assert frz.variable_state("backbone/dense_0/kernel") == "frozen"
    assert frz.variable_state("head/bias") == "frozen"
    assert frz.variable_state("backbone/dense_0/bias") == "trainable"


def test_transformer_by_layer_class_callable_and_where():
    m = transformer()
    plan = ff.Plan(
        [
            ff.freeze(keras.layers.MultiHeadAttention),
            ff.freeze(lambda path, v: path.endswith("gamma")),
            ff.freeze("head/kernel", where=lambda w: w > 0),
        ]
    )
    frz = ff.Freezer(m, plan)
    rep = {v["path"]: v for v in frz.report()["variables"]}
    assert rep["block_0_attn/query/kernel"]["state"] == "frozen"
    assert rep["block_1_ln/gamma"]["state"] == "frozen"
    assert rep["block_1_ln/beta"]["state"] == "trainable"
    head = m.get_layer("head").kernel.numpy()
    assert np.array_equal(frz.frozen_mask("head/kernel"), head > 0)


def test_where_mask_is_evaluated_once():
    x = keras.Variable(np.array([0.0, 1.0, 0.0, 2.0], "float32"), name="w")
    frz = ff.Freezer([x], ff.Plan([ff.freeze("w", where=lambda w: w == 0)]))
    x.assign([5.0, 0.0, 5.0, 0.0])
    assert np.array_equal(frz.frozen_mask("w"), [True, False, True, False])


def test_batchnorm_fully_frozen_is_frozen_as_layer():
    m = mlp(bn=True)
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**/bn_0/*")]))
    bn = m.get_layer("bn_0")
    assert bn.trainable is False  # inference mode, moving statistics fixed
    assert frz.variable_state("mlp/bn_0/moving_mean") == "untrained"
    assert "mlp/bn_0" in frz.report()["frozen_layers"]
    # freezing only gamma leaves the layer in training mode
    m2 = mlp(bn=True)
    ff.Freezer(m2, ff.Plan([ff.freeze("**/bn_0/gamma")]))
    assert m2.get_layer("bn_0").trainable is True


def test_moving_statistics_stay_outside_plans():
    m = mlp(bn=True)
    with pytest.raises(ff.PlanError, match="only variables Keras does not train"):
        ff.Freezer(m, ff.Plan([ff.train("**/moving_mean")]))


def _raw_tf_variable(value, name):
    import tensorflow as tf

    return tf.Variable(value, name=name)


# keras.Variable everywhere; raw tf.Variable objects on TensorFlow
VARIABLES = [keras.Variable] + ([_raw_tf_variable] if BACKEND == "tensorflow" else [])


@pytest.mark.parametrize("make", VARIABLES)
def test_variable_list_and_duplicate_paths(make):
    a = make(np.ones((2, 2), "float32"), name="a")
    b = make(np.ones(3, "float32"), name="b")
    frz = ff.Freezer([a, b], ff.Plan([ff.freeze("a[0]")]))
    assert frz.variable_state("a") == "partial"
    dup = make(np.ones(2, "float32"), name="a")
    with pytest.raises(ff.PlanError, match="share the path 'a'"):
        ff.Freezer([a, dup], ff.Plan([ff.freeze("b")]))


def test_two_freezers_each_follow_their_own_plan():
    m = mlp()
    before = flags(m)
    gen = ff.Freezer(m, ff.Plan([ff.freeze("**/dense_0/**")]))
    disc = ff.Freezer(m, ff.Plan([ff.freeze("**/head/**")]))
    assert "mlp/dense_0/kernel" not in paths(gen.trainable_variables)
    assert "mlp/head/kernel" in paths(gen.trainable_variables)
    assert "mlp/head/kernel" not in paths(disc.trainable_variables)
    assert "mlp/dense_0/kernel" in paths(disc.trainable_variables)
    # flags follow the last created; activate() switches them
    assert paths(m.trainable_variables) == paths(disc.trainable_variables)
    gen.activate()
    assert paths(m.trainable_variables) == paths(gen.trainable_variables)
    # a third Freezer resolves against the state before any Freezer touched it
    third = ff.Freezer(m, ff.Plan([ff.freeze("**/dense_1/**")]))
    assert "mlp/dense_0/kernel" in paths(third.trainable_variables)
    assert "mlp/head/kernel" in paths(third.trainable_variables)
    assert len(before) == len(flags(m))


def test_sparse_selections_are_stored_compactly():
    m = transformer(vocab=20000, d=32)
    frz = ff.Freezer(
        m,
        ff.Plan(
            [ff.freeze("token_embedding/embeddings"), ff.train("token_embedding/embeddings", indices=[(5, 3), (17, 0)])]
        ),
    )
    st = frz._res.by_path("token_embedding/embeddings")
    assert st.mask.n_trainable == 2
    assert st.mask.nbytes <= 16  # an index list, not 640,000 bools
    dense_half = ff.Freezer(m, ff.Plan([ff.freeze("token_embedding/embeddings[::2]")]))
    st = dense_half._res.by_path("token_embedding/embeddings")
    assert st.mask.nbytes == 20000 * 32 // 8  # packed bits


def test_strict_false_warns_instead():
    m = mlp()
    with pytest.warns(ff.FreezeWarning, match="selects nothing"):
        frz = ff.Freezer(m, ff.Plan([ff.freeze("encodr/**"), ff.freeze("**/head/**")], strict=False))
    assert frz.variable_state("mlp/head/kernel") == "frozen"


def test_rule_matching_zero_elements_selects_nothing():
    m = mlp()
    with pytest.raises(ff.PlanError, match="zero of their elements"):
        ff.Freezer(m, ff.Plan([ff.freeze("**/head/kernel", mask=np.zeros((6, 4), bool))]))


def test_report_is_json_able_and_counts_add_up():
    import json

    m = transformer()
    frz = ff.Freezer(m, ff.Plan([ff.freeze("**"), ff.train("head/**"), ff.train("token_embedding/embeddings[40:]")]))
    rep = json.loads(json.dumps(frz.report()))
    t = rep["totals"]
    assert t["trainable_elements"] == 3 * 16 + 3 + 10 * 16
    assert t["trainable_elements"] + t["frozen_elements"] + t["untrained_elements"] == t["elements"]
    emb = next(v for v in rep["variables"] if v["path"] == "token_embedding/embeddings")
    # its gradient is the rows' own (TensorFlow's sparse one; JAX's and PyTorch's sliced rows): compact at any fraction
    assert emb["state"] == "partial" and emb["strategy"] == "compact"
    assert [d["elements"] for d in emb["decided_by"]] == [40 * 16, 10 * 16]
    text = frz.summary(detail=True)
    assert "token_embedding" in text and "partial 80.0% frozen [compact" in text
    assert "3: train('token_embedding/embeddings[40:]')" in text
