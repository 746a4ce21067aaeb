"""A KerasHub causal LM (Gemma-shaped, tiny, random weights from a config) on every backend.

Its model code needs no TensorFlow (``pip install --no-deps keras-hub``):
selection from data, scattered elements of its ``EinsumDense`` projections,
new token rows of its tied embedding, trained through the stand-ins.
"""

import keras
import keras_hub  # in the test extra; a missing install fails here, it does not skip
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, weights_of

VOCAB, SEQ = 64, 12
RNG = np.random.default_rng(0)
X = {"token_ids": RNG.integers(1, VOCAB, (8, SEQ)).astype("int32"), "padding_mask": np.ones((8, SEQ), "int32")}
Y = RNG.integers(1, VOCAB, (8, SEQ)).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def gemma(seed=0):
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        hidden_dim=16,
        intermediate_dim=32,
        num_query_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    # a causal LM as benchmarks/llm_memory.py builds it: the logits are the tied table's reverse projection
    # (KerasHub's GemmaCausalLM.fit wants tf.data or grain for its inputs)
    logits = backbone.token_embedding(backbone(backbone.input), reverse=True)
    return keras.Model(backbone.input, logits, name="lm")


@pytest.mark.slow
def test_fisher_selection_runs_on_every_backend_and_auto_chooses_a_way_that_works():
    """``per_example="auto"`` equals the loop bit for bit where it takes the loop (TensorFlow: attention's softmax)."""
    auto = ff.select(gemma(), (X, Y), budget=0.01, loss=LOSS, batch_size=4, options={"verbose": 0})
    loop = ff.select(
        gemma(), (X, Y), budget=0.01, loss=LOSS, batch_size=4, options={"per_example": "loop", "verbose": 0}
    )
    masks = [{r.selector: r.mask for r in p.rules if getattr(r, "mask", None) is not None} for p in (auto, loop)]
    assert masks[0].keys() == masks[1].keys() and masks[0]
    chosen = sum(int(m.sum()) for m in masks[0].values())
    assert chosen == round(0.01 * sum(int(np.prod(v.shape)) for v in gemma().trainable_variables))
    if BACKEND == "tensorflow":  # the loop: the same sums in the same order
        assert all(np.array_equal(masks[0][k], masks[1][k]) for k in masks[0])
        with pytest.raises(ff.PlanError, match="per_example='vectorized'.*softmax.*'auto' or 'loop'"):
            ff.select(gemma(), (X, Y), budget=0.01, loss=LOSS, options={"per_example": "vectorized", "verbose": 0})


@pytest.mark.parametrize(
    "policy",
    [
        "float32",
        pytest.param("mixed_bfloat16", marks=pytest.mark.slow),
        pytest.param("bfloat16", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("what", ["scattered", "new rows"])
def test_an_llm_trains_scattered_elements_and_new_rows_through_stand_ins_and_keeps_the_rest(what, policy):
    """Frozen elements bit-identical; the kernels' and the table's gradients reach stand-ins of the kernels' dtype."""
    keras.config.set_dtype_policy(policy)
    lm = gemma()
    table = lm.get_layer("token_embedding").embeddings
    if what == "scattered":
        plan = ff.select(lm, budget=0.01, score="random", exclude="**/token_embedding/**", options={"verbose": 0})
    else:
        plan = ff.Plan([ff.freeze("**"), ff.train(f"{table.path}[{VOCAB - 4}:]")])
    frz = ff.Freezer(lm, plan, gradients="sliced")
    kinds = {v["path"]: v["gradient"] for v in frz.report()["variables"] if v["state"] == "partial"}
    assert kinds and set(kinds.values()) <= {"sliced", "sampled"}, kinds
    own = {id(w) for w in weights_of(lm)}
    standins = [v for v in lm.weights if id(v) not in own]
    assert len(standins) == len(kinds)  # one per partially frozen variable, in the model's weights like LoRA's
    assert {v.dtype for v in standins} == {"bfloat16" if policy == "bfloat16" else "float32"}
    # Keras' Adam does not move bfloat16 weights: its 1 - beta_2 ** step rounds to 0 there; Lion's sign does
    inner = keras.optimizers.Lion(1e-2) if policy == "bfloat16" else keras.optimizers.Adam(1e-2)
    lm.compile(optimizer=frz.wrap(inner), loss=LOSS)
    before = [np.array(keras.ops.convert_to_numpy(w)) for w in weights_of(lm)]
    lm.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    frz.verify()
    changed = 0
    for w, b in zip(weights_of(lm), before):
        now = np.array(keras.ops.convert_to_numpy(w))
        if w.path in kinds:
            frozen = frz.frozen_mask(w.path)
            assert np.array_equal(now[frozen], b[frozen]), w.path
            changed += int((now[~frozen] != b[~frozen]).any())
    # every partially frozen variable trained (bfloat16: a few elements' gradients may round to 0 whole)
    assert changed == len(kinds) if policy != "bfloat16" else changed >= len(kinds) - 1, (changed, kinds)
    state = frz.report()["totals"]
    assert state["trainable_elements"] > 0


def test_a_stand_in_given_to_a_public_call_is_named_as_the_stand_in_of_its_kernel():
    """``model.weights`` lists stand-ins (as it lists LoRA's variables): asking for one names its kernel."""
    lm = gemma()
    kernel = "decoder_block_0/attention/key/kernel"
    frz = ff.Freezer(lm, ff.Plan([ff.freeze("**"), ff.train(f"{kernel}[:, :, :4]")]), gradients="sliced")
    standins = [w.path for w in lm.weights if "_trained/" in w.path]
    assert standins == [f"{kernel}_trained/values"]
    for call in (frz.frozen_mask, frz.variable_state):
        with pytest.raises(ff.PlanError, match=f"'{standins[0]}' is the stand-in of '{kernel}'.*Ask for '{kernel}'"):
            call(standins[0])
    standin = next(w for w in lm.weights if w.path == standins[0])
    for given in (standins[0], standin):  # its path, or the variable itself
        with pytest.raises(ff.PlanError, match=f"selects nothing.*is the stand-in of '{kernel}'"):
            ff.Freezer(lm, ff.Plan([ff.freeze("**"), ff.train(given)]))
        with pytest.raises(ff.PlanError, match=f"is the stand-in of '{kernel}'"):
            frz.frozen_mask(given)
    table = lm.get_layer("token_embedding").embeddings
    assert np.array_equal(frz.frozen_mask(table), frz.frozen_mask(table.path))  # a variable for its path
    assert frz.variable_state(kernel) == "partial"
