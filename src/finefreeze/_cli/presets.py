"""KerasHub preset folders and text data for the commands: checked, then loaded.

A preset folder is what KerasHub's ``from_preset`` reads: one written by
``save_to_preset`` (its ``config.json`` names a registered Keras class) or a
Hugging Face checkpoint folder KerasHub converts (its ``config.json`` has a
``model_type``). Text data is a CSV file with ``text`` and ``label``
columns, or a JSONL file of ``{"text": ..., "label": ...}`` objects; labels
are integers ``0..K-1`` or names (sorted, then numbered).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re

import numpy as np

from finefreeze._backends.randomness import set_seed
from finefreeze._files.atomic import UserError
from finefreeze._keras.instances import set_tag, tag

__all__ = [
    "is_preset",
    "is_causal_preset",
    "check_preset",
    "load_preset",
    "load_text_data",
    "text_task",
    "classifier_from_preset",
    "base_from_preset",
    "task_of",
    "new_head",
    "digest_folder",
    "json_lines",
]

HUB_HINT = "pip install 'finefreeze[hub]' (KerasHub)"
TEXT_SUFFIXES = (".csv", ".jsonl")


def is_preset(path: str | None) -> bool:
    """Whether ``path`` is a folder with a ``config.json``: a KerasHub preset or a Hugging Face checkpoint."""
    return path is not None and os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def is_causal_preset(path: str | None) -> bool:
    """Whether ``path`` is a preset folder whose ``task.json`` names a KerasHub causal LM (cheap: no Keras)."""
    if not is_preset(path):
        return False
    try:
        with open(os.path.join(path, "task.json")) as f:
            name = json.load(f)["registered_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(name, str) and name.endswith("CausalLM")


def _config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"preset folder {path!r}: config.json cannot be read ({type(e).__name__})") from None
    if not isinstance(config, dict) or not ({"registered_name", "model_type"} & set(config)):
        raise UserError(
            f"preset folder {path!r}: config.json is neither a KerasHub preset's (no registered_name) nor a "
            "Hugging Face checkpoint's (no model_type); write one with model.save_to_preset(folder)"
        )
    return config


def check_preset(path: str) -> None:
    """Raise :class:`UserError` unless ``path`` is a preset folder KerasHub can read and KerasHub is installed."""
    _config(path)
    _keras_hub()


def _keras_hub():
    try:
        import keras_hub
    except ImportError:
        raise UserError(f"a preset folder needs KerasHub: {HUB_HINT}") from None
    return keras_hub


def load_preset(path: str):
    """The model a preset folder holds: its task when it saved one, else its backbone."""
    check_preset(path)
    keras_hub = _keras_hub()
    import keras

    cls = keras_hub.models.Backbone
    try:
        with open(os.path.join(path, "task.json")) as f:
            cls = keras.saving.get_registered_object(json.load(f)["registered_name"]) or cls
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no task saved (or one this KerasHub does not know): the backbone
    try:
        return cls.from_preset(path)
    except Exception as e:
        raise UserError(f"cannot load preset {path!r}: {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rows(path: str) -> list[tuple[object, object]]:
    if path.endswith(".csv"):
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Excel) is no header
            reader = csv.DictReader(f)
            missing = [c for c in ("text", "label") if c not in (reader.fieldnames or ())]
            if missing:
                raise UserError(
                    f"text data {path!r} needs a header with columns 'text' and 'label' "
                    f"(found: {', '.join(reader.fieldnames or ()) or 'no header'})"
                )
            return [(r["text"], r["label"]) for r in reader]
    rows = []
    for n, obj in json_lines(path, "text data"):
        if not isinstance(obj, dict) or "text" not in obj or "label" not in obj:
            raise UserError(f"text data {path!r}, line {n}: give an object with 'text' and 'label'")
        rows.append((obj["text"], obj["label"]))
    return rows


def json_lines(path: str, what: str):
    """``(line number, object)`` of each non-blank line of a JSON lines file; a line that is no JSON: UserError."""
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except ValueError:
                raise UserError(f"{what} {path!r}, line {n}: not a JSON object") from None


def load_text_data(path: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(texts, labels, names)`` from a CSV or JSONL file; ``names[k]`` is the label class ``k`` stands for."""
    if not os.path.exists(path):
        raise UserError(f"data file {path!r} does not exist")
    if not path.endswith(TEXT_SUFFIXES):
        raise UserError(f"text data {path!r}: give a .csv file (columns text,label) or a .jsonl file")
    try:
        rows = _rows(path)
    except UnicodeDecodeError:
        raise UserError(f"text data {path!r} is not UTF-8 text") from None
    if len(rows) < 2:
        raise UserError(f"text data {path!r} has {len(rows)} rows; give at least 2")
    texts = [t for t, _ in rows]
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise UserError(f"text data {path!r}, row {bad + 1}: the text is {texts[bad]!r}, not a string")
    for i, (_, label) in enumerate(rows):
        if isinstance(label, bool) or not isinstance(label, (str, int)) or not str(label).strip():
            raise UserError(
                f"text data {path!r}, row {i + 1}: the label is {label!r}; give an integer 0..K-1 or a class name"
            )
    raw = [str(label).strip() for _, label in rows]
    if len(set(raw)) < 2:
        raise UserError(f"text data {path!r}: every row has the label {raw[0]!r}; give at least two classes")
    if all(re.fullmatch(r"-?[0-9]+", r) for r in raw):
        labels = np.array([int(r) for r in raw], np.int64)
        if labels.min() < 0:
            raise UserError(f"text data {path!r}: labels must be 0 or more (found {labels.min()})")
        names = [str(k) for k in range(int(labels.max()) + 1)]  # class k is label k, used or not
    else:
        names = sorted(set(raw))
        labels = np.array([names.index(r) for r in raw], np.int64)
    return np.array(texts, dtype=object), labels, names


def text_task(path: str, data: str, *, sequence_length: int):
    """A text classifier from a preset, and its data tokenised once: ``(model, (x, y), (x_val, y_val), names)``.

    The model's preprocessor turns the texts into token ids up front; the
    returned model has it detached (``model.preprocessor`` is None) so that
    training reads the token ids, and the caller puts ``preprocessor`` back
    before saving. The last 10 % of the rows validate.
    """
    check_preset(path)
    texts, labels, names = load_text_data(data)
    model = classifier_from_preset(path, num_classes=len(names), sequence_length=sequence_length)
    pre = model.preprocessor
    longest = getattr(model.backbone, "max_sequence_length", None)
    if longest is not None and sequence_length > longest:
        raise UserError(
            f"--sequence-length {sequence_length} is longer than preset {path!r} allows "
            f"(max_sequence_length {longest}); pass --sequence-length {longest} or less"
        )
    import keras

    x = keras.tree.map_structure(lambda t: np.asarray(keras.ops.convert_to_numpy(t)), pre(list(texts)))
    model.preprocessor = None
    set_tag(model, "_finefreeze_preprocessor", pre)  # put back by the caller before it saves
    set_tag(model, "_finefreeze_labels", names)  # class k stands for names[k] (report.json)
    set_tag(
        model,
        "_finefreeze_base",
        {  # what the delta records, so that `delta apply PRESET` builds this model again
            "preset": os.path.abspath(path),
            "sha256": digest_folder(path),
            "task": "TextClassifier",
            "num_classes": len(names),
            "sequence_length": sequence_length,
        },
    )
    cut = max(1, len(labels) // 10)
    train = ({k: v[:-cut] for k, v in x.items()}, labels[:-cut])
    val = ({k: v[-cut:] for k, v in x.items()}, labels[-cut:])
    return model, train, val, names


def classifier_from_preset(path: str, *, num_classes: int, sequence_length: int):
    """The preset's ``TextClassifier`` with ``num_classes`` outputs and its preprocessor (texts cut to ``sequence_length``).

    The new head's initial values come from Keras' seed: ``finetune`` and
    the commands that rebuild its base (``verify``, ``delta apply``) call
    this right after seeding with 0, so they build the same model.
    """
    check_preset(path)
    keras_hub = _keras_hub()
    try:
        pre = keras_hub.models.TextClassifierPreprocessor.from_preset(path, sequence_length=sequence_length)
        return keras_hub.models.TextClassifier.from_preset(path, num_classes=num_classes, preprocessor=pre)
    except Exception as e:
        raise UserError(
            f"cannot make a text classifier from preset {path!r}: {type(e).__name__}: {_first_line(e)}"
        ) from None


def base_from_preset(path: str, task: dict | None):
    """The model a fine-tune of preset ``path`` started from: the task ``task`` records (seeded as ``finetune``
    seeds it), or what the preset holds when nothing is recorded (a causal LM: with the sequence length it
    was tuned with)."""
    if not task or task.get("task") != "TextClassifier":
        model = load_preset(path)
        pre = getattr(model, "preprocessor", None)
        if task and task.get("task") == "CausalLM" and task.get("sequence_length") and pre is not None:
            pre.sequence_length = int(task["sequence_length"])
        return model
    set_seed(0)
    return classifier_from_preset(
        path, num_classes=int(task["num_classes"]), sequence_length=int(task.get("sequence_length", 128))
    )


def task_of(model) -> dict | None:
    """What :func:`base_from_preset` needs to build ``model``'s base again (a preset's text classifier or causal
    LM), or None."""
    try:
        import keras_hub
    except ImportError:
        return None
    pre = getattr(model, "preprocessor", None)
    length = getattr(pre, "sequence_length", None)
    if isinstance(model, keras_hub.models.CausalLM):
        return {"task": "CausalLM", "sequence_length": int(length) if length else None}
    if not isinstance(model, keras_hub.models.TextClassifier):
        return None
    return {"task": "TextClassifier", "num_classes": int(model.num_classes), "sequence_length": int(length or 128)}


def new_head(model) -> list[str]:
    """Selectors (``**/<layer>/**``) of the layers of a preset's task outside its backbone: the new head, or []."""
    backbone = getattr(model, "backbone", None)
    if backbone is None or tag(model, "_finefreeze_preprocessor", None) is None:
        return []
    inside = {id(w) for w in backbone.weights}
    return [
        f"**/{layer.name}/**"
        for layer in model.layers
        if layer.weights and not any(id(w) in inside for w in layer.weights)
    ]


def digest_folder(path: str) -> str:
    """A sha256 over a folder's file names and contents (a preset's identity for ``--resume``)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            with open(full, "rb") as f:
                for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()
