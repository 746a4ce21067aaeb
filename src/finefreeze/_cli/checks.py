"""What ``finefreeze finetune`` checks before it loads a framework: a refusal comes in well under a second.

The inputs exist and fit each other, the options are in range, ``--out``
may be written (:meth:`Staging.check`) and ``--resume`` has a run to resume
with the same settings. Nothing here imports Keras or a backend.
"""

from __future__ import annotations

import hashlib
import json
import os

from finefreeze._backends.questions import backend_record
from finefreeze._cli.causal import CORPUS_SUFFIXES, load_corpus
from finefreeze._cli.inputs import check_model_file, data_kind, plan_from_keras_file
from finefreeze._cli.parser import EXPORTED, QUANTIZE_MODES, REBUILT
from finefreeze._cli.presets import TEXT_SUFFIXES, digest_folder, is_causal_preset, is_preset
from finefreeze._files.atomic import Staging, UserError

__all__ = ["OUTPUTS", "RESUME", "check_finetune", "check_resume", "done_epochs", "file_digest"]

#: the folder in ``--out`` where a run keeps its resume point (Keras' BackupAndRestore) until its outputs are in place
RESUME = ".finefreeze-resume"

#: every name ``finetune`` may write in ``--out``, and those ``delta apply`` and ``delta export`` write there
#: later without ``-o``: a rerun with ``--force`` drops them (they belong to the run it replaces)
OUTPUTS = (
    "base.keras",
    "tuned.keras",
    "delta.safetensors",
    "report.json",
    "tensorboard",
    "frozen.png",
    "selected-plan.json",
    REBUILT,
    EXPORTED,
)


def check_finetune(
    model_path: str | None,
    *,
    data: str | None,
    plan: str | None,
    optimizer: str,
    lr: float,
    epochs: int,
    batch_size: int,
    strategy: str,
    out: str,
    force: bool,
    resume: bool,
    sequence_length: int,
    plan_written: bool = False,
    quantize: str | None = None,
) -> dict:
    """Raise :class:`UserError` for any input ``finetune`` would refuse; return the run's settings.

    ``plan_written``: ``--select`` writes the plan later (it need not exist yet). A causal LM's preset
    needs no plan: :func:`~finefreeze._cli.causal.default_plan` is its default.
    """
    if epochs < 1 or batch_size < 1 or not lr > 0 or sequence_length < 2:
        raise UserError(
            f"--epochs ({epochs}), --batch-size ({batch_size}) and --lr ({lr}) must be positive, "
            f"--sequence-length ({sequence_length}) at least 2"
        )
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise UserError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE_MODES)}")
    if model_path is not None:
        check_model_file(model_path, preset=True)
        if data is not None and data.endswith(".txt") and not is_causal_preset(model_path):
            raise UserError(
                f"--data {data!r}: a .txt corpus trains a KerasHub causal LM, and {model_path!r} holds none; "
                f"give {data_kind(model_path)}"
            )
        needs_plan = not plan_written and not is_causal_preset(model_path)
        if plan is None and needs_plan and plan_from_keras_file(model_path) is None:
            raise UserError(f"--plan PLAN (or --select SCORE) is required with a model ({model_path!r} holds no plan)")
        if data is None:
            raise UserError(f"--data is required with a model ({data_kind(model_path)})")
    if data is not None and not os.path.exists(data):
        raise UserError(f"data file {data!r} does not exist")
    suffixes = CORPUS_SUFFIXES if is_causal_preset(model_path) else TEXT_SUFFIXES
    if data is not None and is_preset(model_path) != data.endswith(suffixes):
        raise UserError(f"--data {data!r}: give {data_kind(model_path)}")
    if data is not None and is_causal_preset(model_path):
        load_corpus(data)  # a corpus that cannot train is refused before a framework loads
    if plan is not None and not plan_written and not os.path.exists(plan):
        raise UserError(f"plan file {plan!r} does not exist")
    if resume and not os.path.isdir(os.path.join(out, RESUME)) and os.path.exists(os.path.join(out, "report.json")):
        raise UserError(
            f"--resume: the run in --out {out!r} finished (its report.json is there): there is nothing to resume; "
            "run without --resume and with --force to start over, or choose another --out"
        )
    Staging.check(out, OUTPUTS, force=force, inputs=(model_path, data, plan), marker="report.json")
    if plan_written:
        return {}
    settings = _settings(model_path, data, plan, optimizer, lr, epochs, batch_size, strategy)
    settings["sequence_length"] = sequence_length if is_preset(model_path) else None
    settings["quantize"] = quantize
    check_resume(out, settings, resume, force)
    return settings


def done_epochs(point: str) -> int:
    """How many epochs the resume point in ``point`` finished (0: none)."""
    try:
        with open(os.path.join(point, "training_metadata.json")) as f:
            return int(json.load(f)["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def file_digest(path: str | None) -> str | None:
    """A sha256 of a file's bytes or a folder's names and bytes (None for None)."""
    if path is None:
        return None
    if os.path.isdir(path):
        return digest_folder(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _settings(model_path, data, plan, optimizer, lr, epochs, batch_size, strategy) -> dict:
    """What a resumed run must share with the interrupted one (files by their contents)."""
    return {
        "backend": backend_record(),  # the bundled base is pretrained on it; a step's bits depend on it
        "model": file_digest(model_path),
        "data": file_digest(data),
        "plan": file_digest(plan),
        "optimizer": optimizer,
        "lr": lr,
        "epochs": epochs,
        "batch_size": batch_size,
        "strategy": strategy,
    }


_WHAT = {
    "backend": "KERAS_BACKEND",
    "model": "MODEL",
    "data": "--data",
    "plan": "--plan/--select",
    "batch_size": "--batch-size",
    "sequence_length": "--sequence-length",
}


def check_resume(out: str, settings: dict, resume: bool, force: bool) -> None:
    """Refuse (changing nothing) a ``--resume`` with nothing to resume or other settings, or a resume point left unasked."""
    folder = os.path.join(out, RESUME)
    if not resume:
        if os.path.isdir(folder) and not force:
            raise UserError(
                f"--out {out!r} holds the resume point of an interrupted run{_done(folder)}; "
                "pass --resume to continue it, or --force to start over"
            )
        return
    try:
        with open(os.path.join(folder, "settings.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        raise UserError(
            f"--resume: --out {out!r} holds no interrupted run to resume (no {RESUME}/settings.json); "
            "run without --resume"
        ) from None
    for key, now in settings.items():
        if saved.get(key) != now:
            what = _WHAT.get(key, f"--{key}")
            then = saved.get(key)
            then_s, now_s = ("none" if key == "quantize" and v is None else repr(v) for v in (then, now))
            detail = "another file" if key in ("model", "data", "plan") else f"{then_s} then, {now_s} now"
            raise UserError(
                f"--resume: the interrupted run in {out!r} had another {what} ({detail}); "
                "resume with the same command line, or start over with --force"
            )


def _done(folder: str) -> str:
    try:
        with open(os.path.join(folder, "training_metadata.json")) as f:
            return f" (after epoch {int(json.load(f)['epoch'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
