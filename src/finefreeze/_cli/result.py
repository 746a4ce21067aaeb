"""What ``finefreeze finetune`` produced, and the one line it ends with."""

from __future__ import annotations

import dataclasses
import os
import shlex

__all__ = ["Result"]


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


@dataclasses.dataclass
class Result:
    """What :func:`finetune` produced (also written to ``report.json``)."""

    out: str
    trainable_elements: int
    frozen_elements: int
    verified: bool
    delta_bytes: int
    weights_bytes: int
    files: dict
    history: dict
    metric: dict
    base: str = ""  # the base to verify against and rebuild from
    sample: dict | None = None  # a causal LM's greedy text from one prompt, before and after
    quantized: str | None = None  # the mode the base was quantized to (--quantize)

    def line(self) -> str:
        ok = "verify OK (every frozen element bit-identical)" if self.verified else "verify FAILED"
        m = self.metric
        return (
            f"finefreeze finetune: {m['name']} {m['before']:.4f} before, {m['after']:.4f} after; "
            f"{self.trainable_elements:,} elements trained, {self.frozen_elements:,} frozen; "
            f"{ok}; delta {_kib(self.delta_bytes)} = {100 * self.delta_bytes / self.weights_bytes:.1f}% "
            f"of the {_kib(self.weights_bytes)} of weights; wrote {self.out}{self._next()}"
        )

    def _next(self) -> str:
        """How to check the result again and rebuild it from the base and the delta (into ``out/rebuilt.keras``)."""
        if not self.base:
            return ""
        base, out = shlex.quote(_short(self.base)), self.out
        tuned, delta = (shlex.quote(_short(os.path.join(out, name))) for name in ("tuned.keras", "delta.safetensors"))
        check = f". Check: finefreeze verify {base} {tuned}"
        if self.quantized is None:
            return f"{check}; rebuild: finefreeze delta apply {base} {delta}"
        if self.sample is None:  # a quantized kernel's float delta lives beside the integers, not in a .keras file
            model, weights = (_short(os.path.join(out, name)) for name in ("tuned.keras", "delta.safetensors"))
            use = f"ff.load_delta(keras.models.load_model({model!r}), {weights!r})"
            return f"{check}; use it (tuned.keras holds the {self.quantized} base, the delta what trained): {use}"
        prompt, length = shlex.quote(self.sample["prompt"]), self.sample["max_length"]
        return f"{check}; generate: finefreeze generate {base} {prompt} --delta {delta} --max-length {length}"


def _short(path: str) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel
