"""The command line's arguments: one parser per command, every option and its help.

Imports nothing but ``argparse``: ``finefreeze COMMAND --help`` loads no
framework.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

__all__ = ["EXPORTED", "REBUILT", "MAX_LENGTH", "QUANTIZE_MODES", "build_parser"]

_PRESET_HELP = (
    "a .keras model, or a KerasHub preset folder (save_to_preset, or a Hugging Face checkpoint folder "
    "KerasHub converts); default: the bundled text model"
)
#: what ``delta export`` and ``delta apply`` write in the run folder when ``-o`` is not given
EXPORTED, REBUILT = "exported-delta.safetensors", "rebuilt.keras"
#: tokens ``generate`` writes at most, the prompt's included, unless ``--max-length`` says otherwise
MAX_LENGTH = 64
#: the Keras quantization modes ``finetune --quantize`` takes (a plan trains a part of their kernels)
QUANTIZE_MODES = ("int8", "int4")
_PLAN_HELP = "plan file (.json, .toml, .yaml); default: the plan saved in {}"


class _Once(argparse.Action):
    """An option given at most once (argparse would keep the last of several silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} is given twice; give it once")
        setattr(namespace, self.dest, values)


def _command(sub, name: str, fn, help: str, description: str) -> argparse.ArgumentParser:
    """One subcommand: its parser, help line, description and handler."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(fn=fn)
    return p


def build_parser(handlers: Mapping[str, Callable]) -> argparse.ArgumentParser:
    """The argument parser of every command; ``handlers`` maps "finetune", ..., "delta apply" to its function."""
    p = argparse.ArgumentParser(prog="finefreeze", description="Freeze any part of a Keras model, exactly.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _finetune(sub, handlers["finetune"])
    _inspect(sub, handlers["inspect"])
    _verify(sub, handlers["verify"])
    _delta(sub, handlers["delta export"], handlers["delta apply"])
    _generate(sub, handlers["generate"])
    return p


def _finetune(sub, fn: Callable) -> None:
    ft = _command(
        sub,
        "finetune",
        fn,
        "fine-tune a model under a plan (bundled example by default)",
        "Fine-tune MODEL under PLAN, verify that every frozen element is bit-identical, and write "
        "tuned.keras, delta.safetensors, report.json, a TensorBoard log and frozen.png to the run folder (-o/--out). "
        "MODEL may be a KerasHub preset folder with text data (--data texts.csv): a text classifier, or, when the "
        "preset holds a causal LM, fine-tuned on a corpus (--data corpus.txt) under a default plan that trains 1% "
        "of the columns of every attention and feed-forward kernel and the norms. "
        "With no MODEL: a bundled pretrained text model extended with new tokens, its data, and a "
        "plan that trains only the new embedding rows and the head.",
    )
    ft.add_argument("model", nargs="?", help=_PRESET_HELP)
    ft.add_argument(
        "--data",
        help="required with MODEL: .npz with x, y (optional x_val, y_val) for a .keras model; "
        ".csv (columns text,label) or .jsonl for a preset, whose model is then a text classifier; "
        "for a causal LM's preset a corpus: .txt (one example per line) or .jsonl (text, or prompt and response)",
    )
    ft.add_argument(
        "--plan", help=_PLAN_HELP.format("MODEL, or the bundled plan") + " (a causal LM's preset: its default plan)"
    )
    ft.add_argument("--optimizer", default="adamw", help="a Keras optimizer name (default: adamw)")
    ft.add_argument("--lr", type=float, default=5e-3, help="learning rate (default: 5e-3)")
    ft.add_argument("--epochs", type=int, default=4, help="epochs (default: 4)")
    ft.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    ft.add_argument("--sequence-length", type=int, default=128, help="with a preset: tokens per text (default: 128)")
    ft.add_argument(
        "--strategy",
        default="auto",
        choices=["auto", "restore", "compact", "mask"],
        help="how partially frozen variables are enforced (default: auto)",
    )
    ft.add_argument("-o", "--out", default="finefreeze-out", help="the run folder to write (default: ./finefreeze-out)")
    ft.add_argument("--force", action="store_true", help="replace the files of a previous run in the run folder")
    ft.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in the run folder from its last finished epoch "
        "(same command line otherwise)",
    )
    ft.add_argument("-q", "--quiet", action="store_true", help="print only the final line")
    _what_trains(ft)


def _what_trains(ft) -> None:
    """``finetune``'s options on what trains and on what base: ``--select``, ``--budget``, ``--prompt``, ``--quantize``."""
    ft.add_argument(
        "--select",
        choices=["fisher", "gradient", "magnitude", "delta", "random"],
        help="choose the trained elements from the training data with this score (ff.select) instead of --plan",
    )
    ft.add_argument(
        "--budget",
        default=None,
        help="with --select: a fraction (0.01), a percent (1%%) or a count of elements (5000) (default: 1%%)",
    )
    ft.add_argument(
        "--prompt",
        help="a causal LM's preset: the prompt of the greedy text report.json shows before and after "
        "(default: the first words of the first validation example)",
    )
    ft.add_argument(
        "--quantize",
        choices=QUANTIZE_MODES,
        help="quantize the base with Keras first (QLoRA's base): every Dense, EinsumDense and Embedding layer "
        "but those whose kernel the plan trains in full and those inside a MultiHeadAttention; what the plan "
        "trains of a quantized kernel is a float delta beside its integers (delta.safetensors; generate and "
        "verify quantize the base the same way)",
    )


def _inspect(sub, fn: Callable) -> None:
    ins = _command(
        sub,
        "inspect",
        fn,
        "show what a plan freezes, without training",
        "Print the freeze summary of MODEL under PLAN (bundled example by default).",
    )
    ins.add_argument("model", nargs="?", help=_PRESET_HELP)
    ins.add_argument("--plan", help=_PLAN_HELP.format("MODEL, or the bundled plan"))
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("--layers-only", action="store_true", help="one row per layer")


def _verify(sub, fn: Callable) -> None:
    ver = _command(
        sub,
        "verify",
        fn,
        "check that a fine-tune left every frozen element bit-identical",
        "Exit 0 when every element PLAN freezes is bit-identical in BASE and TUNED, 1 otherwise.",
    )
    ver.add_argument("base", help="the .keras model or KerasHub preset folder fine-tuning started from")
    ver.add_argument("tuned", help="the fine-tuned .keras model")
    ver.add_argument("--plan", help=_PLAN_HELP.format("TUNED"))


def _delta(sub, export: Callable, apply: Callable) -> None:
    dl = sub.add_parser("delta", help="export or apply a delta file", description="Delta files (safetensors).")
    dsub = dl.add_subparsers(dest="delta_command", required=True, metavar="ACTION")
    ex = _command(
        dsub,
        "export",
        export,
        "write what TUNED trained to a delta file",
        "Write the trainable elements of TUNED under PLAN to a .safetensors delta.",
    )
    ex.add_argument("tuned", help="the fine-tuned .keras model")
    ex.add_argument("-o", "--out", help=f"the .safetensors file to write (default: {EXPORTED} beside TUNED)")
    ex.add_argument("--plan", help=_PLAN_HELP.format("TUNED"))
    ex.add_argument("--force", action="store_true", help="replace an existing output file")
    ap = _command(
        dsub,
        "apply",
        apply,
        "apply delta files to their base model",
        "Apply DELTA to BASE (refused if BASE's frozen part differs) and save the result with the plan it "
        "was trained under, so that `finefreeze verify BASE OUT` checks it. Several deltas trained on disjoint "
        "elements of BASE combine (as merge_deltas); overlapping ones are refused.",
    )
    ap.add_argument("base", help="the .keras base model, or the KerasHub preset folder fine-tuning started from")
    ap.add_argument("delta", nargs="+", help="one or more .safetensors deltas of BASE")
    ap.add_argument("-o", "--out", help=f"the .keras file to write (default: {REBUILT} beside the first DELTA)")
    ap.add_argument("--force", action="store_true", help="replace an existing output file")


def _generate(sub, fn: Callable) -> None:
    gen = _command(
        sub,
        "generate",
        fn,
        "print greedy text from a causal LM (a delta applied first)",
        "Load the causal LM of MODEL, apply DELTA when given, and print the greedy continuation of PROMPT "
        "(the prompt included): the same command prints the same text.",
    )
    gen.add_argument("model", help="a KerasHub CausalLM preset folder (save_to_preset) or a tuned causal LM's .keras")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument(
        "--delta",
        action=_Once,
        help="a .safetensors delta of MODEL (finetune's delta.safetensors) to apply first; merge several with "
        "finefreeze delta apply. A finetune --quantize run's tuned.keras needs its delta (the kernels' float "
        "deltas are in it only)",
    )
    gen.add_argument("--max-length", type=int, default=64, help="tokens at most, the prompt's included (default: 64)")
