"""Tiny KerasHub causal-LM tasks (Gemma- and Llama-shaped) built from a config, with a tokenizer trained here.

No download: a sentencepiece model is trained on :data:`CORPUS` in a few
milliseconds, the backbone gets random weights from its seed, and
:func:`make_preset` writes a preset folder with KerasHub's own
``save_to_preset``. Every backend: off TensorFlow, KerasHub's tokenizer runs
on the ``sentencepiece`` package and a task's ``fit`` on ``grain``.
"""

from __future__ import annotations

import io

import keras
import keras_hub
import numpy as np
import sentencepiece as spm

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song at dawn",
    "we like to read old books",
    "the sun rose over the hills",
    "she wrote a letter to her friend",
    "rain fell on the quiet town",
    "the child built a house of sand",
] * 8
PROMPT = "the cat"
SEQ = 16

#: per family: the tokenizer's special pieces (pad, eos, bos, unk ids 0..3), task classes and backbone config
FAMILIES = {
    "gemma": dict(
        pieces=("<pad>", "<eos>", "<bos>", "<unk>"),
        tokenizer=keras_hub.models.GemmaTokenizer,
        preprocessor=keras_hub.models.GemmaCausalLMPreprocessor,
        backbone=keras_hub.models.GemmaBackbone,
        task=keras_hub.models.GemmaCausalLM,
        config=dict(
            num_layers=2, hidden_dim=16, intermediate_dim=32, num_query_heads=2, num_key_value_heads=1, head_dim=8
        ),
    ),
    "llama": dict(
        pieces=("<pad>", "</s>", "<s>", "<unk>"),
        tokenizer=keras_hub.models.LlamaTokenizer,
        preprocessor=keras_hub.models.LlamaCausalLMPreprocessor,
        backbone=keras_hub.models.LlamaBackbone,
        task=keras_hub.models.LlamaCausalLM,
        config=dict(num_layers=2, hidden_dim=16, intermediate_dim=32, num_query_heads=2, num_key_value_heads=1),
    ),
}


def sentencepiece_proto(family: str, vocab: int = 40) -> bytes:
    """A unigram sentencepiece model trained on :data:`CORPUS` with ``family``'s special pieces."""
    pad, eos, bos, unk = FAMILIES[family]["pieces"]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=out,
        vocab_size=vocab,
        model_type="unigram",
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece=pad,
        eos_piece=eos,
        bos_piece=bos,
        unk_piece=unk,
        minloglevel=2,
        num_threads=1,
    )
    return out.getvalue()


def task(family: str = "gemma", *, seed: int = 0, preprocessor: bool = True):
    """A KerasHub causal-LM task of ``family`` with random weights (``preprocessor=False``: token ids in)."""
    f = FAMILIES[family]
    tokenizer = f["tokenizer"](proto=sentencepiece_proto(family))
    keras.utils.set_random_seed(seed)
    backbone = f["backbone"](vocabulary_size=tokenizer.vocabulary_size(), **f["config"])
    pre = f["preprocessor"](tokenizer, sequence_length=SEQ) if preprocessor else None
    return f["task"](backbone, preprocessor=pre)


def token_batch(lm, n: int = 8, seed: int = 0):
    """``(x, y, sample_weight)`` of token ids for a task without its preprocessor (as the preprocessor makes them)."""
    rng = np.random.default_rng(seed)
    vocab = lm.backbone.vocabulary_size
    ids = rng.integers(4, vocab, (n, SEQ + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, SEQ), "int32")}
    return x, ids[:, 1:], np.ones((n, SEQ), "float32")


def make_preset(path, family: str = "gemma", *, seed: int = 0) -> str:
    """A preset folder of a ``family`` task at ``path`` (KerasHub's ``save_to_preset``); returns the path."""
    task(family, seed=seed).save_to_preset(str(path))
    return str(path)
