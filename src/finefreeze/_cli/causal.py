"""Causal language models on the command line: corpora, the default plan, perplexity and greedy text.

A preset folder whose ``task.json`` names a KerasHub ``CausalLM`` fine-tunes
on a corpus: a ``.txt`` file (one example per non-empty line) or a
``.jsonl`` file of ``{"text": ...}`` or ``{"prompt": ..., "response": ...}``
objects. A prompt and its response train as one string, ``prompt +
response`` as written, and the loss counts the response's tokens only. The
texts are tokenised once by the task's own preprocessor; the metric is the
validation perplexity, ``exp`` of the mean next-token cross-entropy over
the tokens the loss counts, and the sample is greedy text from a fixed
prompt.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from finefreeze._cli.presets import check_preset, digest_folder, json_lines, load_preset
from finefreeze._files.atomic import UserError, check_interrupt
from finefreeze._keras.instances import set_tag, tag
from finefreeze._keras.layers import all_layers
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import freeze, train

__all__ = [
    "CORPUS_SUFFIXES",
    "COLUMNS",
    "is_causal_lm",
    "load_corpus",
    "causal_task",
    "require_causal_lm",
    "default_plan",
    "lm_loss",
    "perplexity",
    "generate_text",
]

CORPUS_SUFFIXES = (".txt", ".jsonl")
#: the share of each attention and feed-forward kernel's columns (its last axis) the default plan trains
COLUMNS = 0.01
#: words of the first validation text that make the report's sample prompt
PROMPT_WORDS = 4
#: logits held at once while measuring perplexity (rows x tokens x vocabulary)
_LOGITS = 1 << 24


def is_causal_lm(model) -> bool:
    """Whether ``model`` is a KerasHub ``CausalLM`` (False when KerasHub is not installed)."""
    try:
        import keras_hub
    except ImportError:
        return False
    return isinstance(model, keras_hub.models.CausalLM)


def _examples(path: str) -> list[tuple[str, str | None]]:
    """``(text, prompt)`` per example: the string that trains, and the prompt its loss skips (None: none)."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8-sig") as f:
            return [(line.strip(), None) for line in f if line.strip()]
    rows = []
    for n, obj in json_lines(path, "corpus"):
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            rows.append((obj["text"], None))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
            rows.append((obj["prompt"] + obj["response"], obj["prompt"]))
        else:
            raise UserError(
                f"corpus {path!r}, line {n}: give an object with a string 'text', or strings 'prompt' and 'response'"
            )
    return rows


def load_corpus(path: str) -> list[tuple[str, str | None]]:
    """The examples of a ``.txt`` or ``.jsonl`` corpus, checked: at least two (one trains, one validates)."""
    if not os.path.exists(path):
        raise UserError(f"data file {path!r} does not exist")
    if not path.endswith(CORPUS_SUFFIXES):
        raise UserError(
            f"corpus {path!r}: give a .txt file (one example per line) or a .jsonl file "
            "(objects with 'text', or 'prompt' and 'response')"
        )
    try:
        rows = _examples(path)
    except UnicodeDecodeError:
        raise UserError(f"corpus {path!r} is not UTF-8 text") from None
    if len(rows) < 2:
        raise UserError(f"corpus {path!r} has {len(rows)} examples; give at least 2 (the last 10 % validate)")
    return rows


def _numpy(tree):
    import keras

    return keras.tree.map_structure(lambda t: np.asarray(keras.ops.convert_to_numpy(t)), tree)


def _tokens(pre, prompt: str) -> int:
    """How many tokens the preprocessor's tokenizer makes of ``prompt``."""
    return int(np.asarray(_numpy(pre.tokenizer(prompt))).size)


def causal_task(path: str, data: str, *, sequence_length: int):
    """A preset's causal LM and its corpus tokenised once: ``(model, (x, y, w), (x_val, y_val, w_val))``.

    ``w`` weighs each next-token target: 1 where the loss counts it, 0 on
    padding and on a prompt's tokens. The model has its preprocessor
    detached (as :func:`~finefreeze._cli.presets.text_task` leaves a
    classifier); the caller puts it back before saving. The last 10 % of
    the examples (at least one) validate.
    """
    check_preset(path)
    rows = load_corpus(data)
    model = require_causal_lm(load_preset(path), path)
    pre = model.preprocessor
    if pre is None:
        raise UserError(f"preset {path!r} saved no preprocessor; save the task with its preprocessor")
    longest = getattr(model.backbone, "max_sequence_length", None)
    if longest is not None and sequence_length > longest:
        raise UserError(
            f"--sequence-length {sequence_length} is longer than preset {path!r} allows "
            f"(max_sequence_length {longest}); pass --sequence-length {longest} or less"
        )
    pre.sequence_length = sequence_length
    x, y, w = _numpy(pre([text for text, _ in rows]))
    w = np.asarray(w, np.float32)
    start = 1 if getattr(pre, "add_start_token", True) else 0
    for i, (_, prompt) in enumerate(rows):
        if prompt is not None:  # the targets that are the prompt's own tokens do not count
            w[i, : max(0, _tokens(pre, prompt) + start - 1)] = 0
    cut = max(1, len(rows) // 10)
    if not w[-cut:].any():
        raise UserError(
            f"corpus {data!r}: no validation response has a token within --sequence-length {sequence_length}; "
            "pass a longer --sequence-length"
        )
    model.preprocessor = None
    set_tag(model, "_finefreeze_preprocessor", pre)  # put back by the caller before it saves
    first_prompt = rows[-cut][1]
    if first_prompt is None:
        words = rows[-cut][0].split()
        first_prompt = " ".join(words[: max(1, min(PROMPT_WORDS, len(words) - 1))])
    set_tag(model, "_finefreeze_prompt", first_prompt)  # the report's sample starts from it
    set_tag(
        model,
        "_finefreeze_base",
        {"preset": os.path.abspath(path), "sha256": digest_folder(path), "task": "CausalLM"}
        | {"sequence_length": sequence_length},
    )
    train = ({k: v[:-cut] for k, v in x.items()}, y[:-cut], w[:-cut])
    val = ({k: v[-cut:] for k, v in x.items()}, y[-cut:], w[-cut:])
    return model, train, val


def require_causal_lm(model, path: str):
    """``model`` when it is a KerasHub ``CausalLM`` (from ``path``); :class:`UserError` otherwise."""
    if not is_causal_lm(model):
        raise UserError(
            f"{path!r} holds a {type(model).__name__}, not a causal language model "
            "(a KerasHub CausalLM task saved with save_to_preset, or its tuned .keras file)"
        )
    return model


def default_plan(model) -> Plan:
    """The plan of a causal LM fine-tuned without ``--plan``: 1 % of the columns of every kernel, and the norms.

    Every kernel (the attention's query, key, value and output projections,
    the feed-forward layers) trains its first 1 % of columns (its last axis;
    rounded half up, at least one); every normalisation layer trains in
    full; the rest (the token embedding included) is frozen.
    """
    rules = [freeze("**"), train("**/kernel", columns=COLUMNS)]
    for layer in all_layers(getattr(model, "backbone", model), include_self=False):
        if "norm" in type(layer).__name__.lower():
            rules += [train(v.path) for v in layer.trainable_weights]
    return Plan(rules)


def lm_loss():
    """The next-token cross-entropy on logits, as the task trains with it."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def perplexity(model, val: tuple, batch_size: int) -> float:
    """``exp`` of the mean next-token cross-entropy over the validation targets whose weight is not 0."""
    import keras

    x, y, w = val
    vocab = int(model.backbone.vocabulary_size)
    rows = max(1, min(batch_size, _LOGITS // max(1, y.shape[1] * vocab)))
    total, count = 0.0, float(w.sum())
    for s in range(0, len(y), rows):
        check_interrupt()  # between two batches (see finetune's interrupts_at_checks)
        batch = {k: v[s : s + rows] for k, v in x.items()}
        logits = np.asarray(keras.Model.predict_on_batch(model, batch), np.float64)
        top = logits.max(axis=-1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
        picked = np.take_along_axis(logits, y[s : s + rows, :, None].astype(np.int64), axis=-1)[..., 0]
        total += float(((lse - picked) * w[s : s + rows]).sum())
    return math.exp(total / count)


def generate_text(model, prompt: str, max_length: int) -> str:
    """Greedy text from ``prompt`` (at most ``max_length`` tokens, the prompt's included): the same text every run."""
    import keras
    import keras_hub

    detached = tag(model, "_finefreeze_preprocessor", None)
    if detached is not None:
        model.preprocessor = detached
    try:
        if not prompt.strip():
            raise UserError("the prompt is empty; give the text to continue")
        mask = model.preprocessor.generate_preprocess([prompt])["padding_mask"]
        n = int(np.sum(keras.ops.convert_to_numpy(mask)))
        if n >= max_length:
            raise UserError(
                f"the prompt is {n} tokens, --max-length {max_length} leaves none to generate (the prompt counts); "
                f"raise --max-length above {n}"
            )
        if not isinstance(getattr(model, "sampler", None), keras_hub.samplers.GreedySampler):
            model.sampler = keras_hub.samplers.GreedySampler()
            model.generate_function = None  # it holds the sampler it was made with
        try:
            return str(model.generate(prompt, max_length=max_length))
        except (MemoryError, RuntimeError) as e:  # the frameworks' out-of-memory errors are RuntimeErrors
            if not re.search(r"RESOURCE_EXHAUSTED|allocate|out of memory", str(e), re.IGNORECASE):
                raise
            raise UserError(f"--max-length {max_length}: out of memory generating that many tokens; lower it") from None
    finally:
        if detached is not None:
            model.preprocessor = None
