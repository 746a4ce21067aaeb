"""KerasHub causal-LM tasks as they are (Gemma- and Llama-shaped, from a config) under every kind of plan.

Each plan trains through the task's own ``compile`` / ``fit`` (token ids with
``preprocessor=None``, or strings through the task's preprocessor), frozen
elements stay bit-identical (``verify()`` and a byte comparison), and the
task's own ``generate()`` answers. Three deltas of one base served with
``ff.DeltaSwitch`` give, with a greedy sampler, exactly the tokens of each
task's own fine-tuned model.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from causal_lms import CORPUS, PROMPT, SEQ, task, token_batch

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
KINDS = ["block", "columns", "new rows", "elements", "lora + sparse"]


def plan_for(kind: str, lm, data):
    """A plan of ``kind`` for ``lm`` (``data``: token batches for ``select``)."""
    vocab = lm.backbone.vocabulary_size
    if kind == "block":
        return ff.Plan([ff.freeze("**"), ff.train(ff.blocks(lm)[-1])])
    if kind == "columns":
        return ff.Plan([ff.freeze("**"), ff.train("**/*attention/**/kernel", columns="25%")])
    if kind == "new rows":  # the last 4 tokens' rows, of the tied table (and of Llama's untied output table)
        rules = [ff.freeze("**"), ff.train(f"token_embedding/embeddings[{vocab - 4}:]")]
        if any(w.path == "token_embedding/reverse_embeddings" for w in lm.weights):
            rules.append(ff.train(f"token_embedding/reverse_embeddings[:, {vocab - 4}:]"))
        return ff.Plan(rules)
    if kind == "elements":
        x, y, _ = data
        return ff.select(lm, (x, y), budget=0.05, loss=LOSS, exclude="**/token_embedding/**", spread="kind",
                         batch_size=4, options={"verbose": 0})  # fmt: skip
    assert kind == "lora + sparse"
    lm.backbone.enable_lora(2)
    return ff.select(lm, budget=0.05, score="random", include="**/lora_kernel_*", exclude="**/token_embedding/**",
                     spread="kind")  # fmt: skip


def values(lm):
    return {w.path: np.array(keras.ops.convert_to_numpy(w)) for w in weights_of(lm)}


def check_trained_exactly(lm, frz, before):
    frz.verify()
    moved = 0
    for w in weights_of(lm):
        now, was = np.array(keras.ops.convert_to_numpy(w)), before[w.path]
        frozen = frz.frozen_mask(w.path)
        assert np.array_equal(now[frozen], was[frozen]), w.path
        moved += int((now[~frozen] != was[~frozen]).any())
    assert moved > 0


def token_prompt(n: int = 4):
    x, _, _ = token_batch(task("gemma", preprocessor=False), n=1, seed=7)
    mask = (np.arange(SEQ) < n).astype("int32")[None]
    return {"token_ids": x["token_ids"] * mask, "padding_mask": mask}


@pytest.mark.parametrize("family", ["gemma", "llama"])
@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) if k == "lora + sparse" else k for k in KINDS]
)
def test_each_plan_kind_trains_through_the_task_fit_on_token_ids_and_generate_answers(family, kind):
    lm = task(family, preprocessor=False)
    data = token_batch(lm)
    plan = plan_for(kind, lm, data)
    frz = ff.Freezer(lm, plan)
    lm.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), sampler="greedy")  # the task's own loss
    before = values(lm)
    x, y, w = data
    lm.fit(x, y, sample_weight=w, batch_size=4, epochs=2, verbose=0)
    check_trained_exactly(lm, frz, before)
    out = lm.generate(token_prompt(), stop_token_ids=None)  # no preprocessor: no end token to stop at
    assert out["token_ids"].shape == (1, SEQ) and out["padding_mask"].all()


@pytest.mark.parametrize("family", ["gemma", "llama"])
@pytest.mark.parametrize("kind", ["columns", pytest.param("new rows", marks=pytest.mark.slow)])
def test_a_plan_trains_on_strings_through_the_task_preprocessor(family, kind):
    lm = task(family)
    plan = plan_for(kind, lm, None)
    frz = ff.Freezer(lm, plan)
    lm.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), sampler="greedy")
    before = values(lm)
    lm.fit(CORPUS[:16], batch_size=4, epochs=1, verbose=0)
    check_trained_exactly(lm, frz, before)
    text = lm.generate(PROMPT, max_length=SEQ)
    assert isinstance(text, str) and text.startswith(PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_three_deltas_switched_on_one_base_generate_each_task_tokens_exactly(family, tmp_path):
    tuned, paths = {}, {}
    for name in ("columns", "new rows", "elements"):
        lm = task(family, preprocessor=False)  # the same base each time (the same seed)
        data = token_batch(lm, seed=len(name))  # three tasks, three data sets
        frz = ff.Freezer(lm, plan_for(name, lm, data))
        lm.compile(optimizer=frz.wrap(keras.optimizers.Adam(2e-2)), sampler="greedy")
        x, y, w = data
        lm.fit(x, y, sample_weight=w, batch_size=4, epochs=2, verbose=0)
        paths[name] = str(tmp_path / f"{name.replace(' ', '-')}.safetensors")
        frz.save_delta(paths[name])
        tuned[name] = lm
    served = task(family, preprocessor=False)
    served.compile(sampler="greedy")
    base_tokens = served.generate(token_prompt(), stop_token_ids=None)["token_ids"]
    switch = ff.DeltaSwitch(served, paths)
    answers = {}
    for name in ("elements", "columns", "new rows", None, "columns"):
        switch.use(name)
        got = served.generate(token_prompt(), stop_token_ids=None)["token_ids"]
        want = base_tokens if name is None else tuned[name].generate(token_prompt(), stop_token_ids=None)["token_ids"]
        assert np.array_equal(got, want), name
        answers[name] = got
    assert len({a.tobytes() for a in answers.values()}) > 1  # the tasks answer differently


def test_new_tokens_of_a_quantized_untied_llama_train_both_tables_and_a_delta_file_serves_them(tmp_path):
    lm = task("llama", preprocessor=False)
    lm.quantize("int8")
    data = token_batch(lm)
    frz = ff.Freezer(lm, plan_for("new rows", lm, data))  # the token table's new rows and the output table's columns
    table = lm.backbone.token_embedding
    lm.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), sampler="greedy")
    before = values(lm)
    x, y, w = data
    lm.fit(x, y, sample_weight=w, batch_size=4, epochs=2, verbose=0)
    frz.verify()
    after = values(lm)
    assert all(np.array_equal(after[p], v) for p, v in before.items() if "_trained" not in p)  # every stored byte
    for mark in (table._finefreeze_sliced, table._finefreeze_sliced_reverse):
        assert np.count_nonzero(keras.ops.convert_to_numpy(mark.standin)) == 4 * lm.backbone.hidden_dim
    frz.save_delta(tmp_path / "new-tokens.safetensors")
    served = task("llama", preprocessor=False)
    served.quantize("int8")
    ff.load_delta(served, tmp_path / "new-tokens.safetensors")
    served.compile(sampler="greedy")
    assert np.array_equal(served.predict(x, verbose=0), lm.predict(x, verbose=0))  # the logits, bit for bit
    want = lm.generate(token_prompt(), stop_token_ids=None)["token_ids"]
    assert np.array_equal(served.generate(token_prompt(), stop_token_ids=None)["token_ids"], want)
