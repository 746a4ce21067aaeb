"""``finefreeze generate``: greedy text from a causal LM's preset folder or tuned model, a delta applied first.

The model is a preset folder whose ``task.json`` names a KerasHub
``CausalLM`` or the ``tuned.keras`` of a causal LM's fine-tune; ``--delta``
applies a delta file to it as :func:`finefreeze.load_delta` does (all or
nothing, checked against the model's frozen part); a delta trained on a
quantized base (``finetune --quantize``) quantizes the model's float kernels
the same way first. The sampler is greedy:
the same command prints the same text.
"""

from __future__ import annotations

import os

from finefreeze._cli.causal import generate_text, require_causal_lm
from finefreeze._cli.inputs import check_model_file, load_model
from finefreeze._cli.parser import MAX_LENGTH
from finefreeze._cli.presets import is_causal_preset, is_preset
from finefreeze._cli.quantize import delta_quantization, quantize_as, refuse_without_delta
from finefreeze._files.atomic import UserError
from finefreeze._files.delta import load_delta

__all__ = ["check_generate", "generate"]


def check_generate(model_path: str, *, delta: str | None, max_length: int) -> None:
    """Raise :class:`~finefreeze._files.atomic.UserError` for inputs ``generate`` would refuse (no model loaded)."""
    if max_length < 1:
        raise UserError(f"--max-length ({max_length}) must be at least 1")
    check_model_file(model_path, preset=True)
    if is_preset(model_path) and not is_causal_preset(model_path):
        raise UserError(
            f"preset {model_path!r} holds no causal language model (its task.json names no KerasHub CausalLM); "
            "generate takes a CausalLM's preset folder or a tuned causal LM's .keras file"
        )
    if delta is not None and not os.path.exists(delta):
        raise UserError(f"delta file {delta!r} does not exist")
    if delta is not None and os.path.isdir(delta):
        raise UserError(f"delta {delta!r} is a folder; give a .safetensors delta file")


def generate(model_path: str, prompt: str, *, delta: str | None = None, max_length: int = MAX_LENGTH) -> str:
    """Greedy text from ``prompt`` (its first ``max_length`` tokens, the prompt's included) by the causal LM at
    ``model_path``, with ``delta`` applied first when given."""
    check_generate(model_path, delta=delta, max_length=max_length)
    model = require_causal_lm(load_model(model_path, preset=True), model_path)
    if model.preprocessor is None:
        raise UserError(f"{model_path!r} holds no preprocessor: generate needs the task's tokenizer")
    if delta is None and not is_preset(model_path):
        refuse_without_delta(model, model_path)  # a quantized run's tuned.keras: its deltas are in its delta file
    if delta is not None:  # a delta trained on a quantized base: the base quantized the same way first
        quantize_as(model, delta_quantization(delta), repr(delta))
        load_delta(model, delta)  # a damaged delta, or one of another model: DeltaError, exit 2
    return generate_text(model, prompt, max_length)
