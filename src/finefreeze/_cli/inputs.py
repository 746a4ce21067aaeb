"""The inputs of the commands: model files, plans and data, checked before any slow work.

Every problem is a :class:`UserError` with one line that names the file and
how to fix it: a missing file, a folder or a damaged or foreign file given as
a model, a plan that cannot be read, data whose shapes do not fit the model.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
import zlib

import numpy as np

from finefreeze._cli.causal import causal_task
from finefreeze._cli.presets import base_from_preset, check_preset, is_causal_preset, is_preset, load_preset, text_task
from finefreeze._files.atomic import UserError, interrupts_at_checks
from finefreeze._keras.layers import all_layers, inbound_tensors

__all__ = [
    "UserError",
    "check_model_file",
    "load_model",
    "base_model",
    "plan_from_keras_file",
    "optimizer_from_keras_file",
    "load_plan",
    "load_data",
    "training_inputs",
    "data_kind",
]


def check_model_file(path: str, *, preset: bool = False) -> None:
    """Raise :class:`UserError` unless ``path`` looks like a complete ``.keras`` file (cheap: no Keras).

    With ``preset=True`` a KerasHub preset folder (or a Hugging Face
    checkpoint folder KerasHub converts) is accepted too.
    """
    if not os.path.exists(path):
        raise UserError(f"model file {path!r} does not exist")
    if os.path.isdir(path):
        if preset and is_preset(path):
            return check_preset(path)
        also = " or a KerasHub preset folder (one with a config.json)" if preset else ""
        raise UserError(
            f"model {path!r} is a folder; give a .keras file{also} (save one with model.save('model.keras'))"
        )
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            zip_magic = f.read(4) == b"PK\x03\x04"
        if zip_magic:
            raise UserError(f"model file {path!r} is damaged or truncated (an incomplete zip archive)") from None
        raise UserError(
            f"{path!r} is not a Keras model file (.keras, a zip archive); save the model with model.save('model.keras')"
        ) from None
    if "config.json" not in names:
        raise UserError(f"{path!r} is not a Keras model file: its archive holds no config.json")


def load_model(path: str | None, *, preset: bool = False):
    """A Keras model from a ``.keras`` file (the bundled pretrained model for None), or a preset folder."""
    if path is None:
        from finefreeze._cli.epochs import stop_on_interrupt
        from finefreeze._data.text_model import pretrained_text_model

        with interrupts_at_checks():  # a signal stops the pretraining between two batches
            return pretrained_text_model(callbacks=[stop_on_interrupt()])
    if preset and is_preset(path):
        return load_preset(path)
    check_model_file(path)
    import keras

    from finefreeze._imports import register_keras_classes

    register_keras_classes()  # finefreeze's own classes (the optimizer, the bundled model's layer)
    try:
        with warnings.catch_warnings():  # a KerasHub task compiles itself when built: Keras then says it skips
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")  # the saved one
            return keras.models.load_model(path, compile=False)
    except Exception as e:
        raise UserError(f"cannot load model {path!r}: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None


def base_model(path: str, task: dict | None):
    """The model fine-tuning started from: a ``.keras`` file, or a preset folder (``task``: what was built on it)."""
    return base_from_preset(path, task) if is_preset(path) else load_model(path)


def _saved_freezing_optimizer(path: str) -> dict | None:
    """The config of the ``FreezingOptimizer`` saved in a ``.keras`` file's compile config, or None."""
    try:
        with zipfile.ZipFile(path) as z:
            config = json.loads(z.read("config.json"))
    except (OSError, KeyError):
        return None
    except (zipfile.BadZipFile, zlib.error, ValueError) as e:  # a checksum or JSON that does not read: damaged
        raise UserError(f"{path!r} is damaged: its config.json does not read ({type(e).__name__}: {e})") from None
    opt = (config.get("compile_config") or {}).get("optimizer")
    while isinstance(opt, dict):
        if opt.get("class_name") == "FreezingOptimizer":
            return opt.get("config", {})
        opt = opt.get("config", {}).get("inner_optimizer")
    return None


def plan_from_keras_file(path: str):
    """The plan a ``FreezingOptimizer`` saved in a ``.keras`` file's compile config, or None."""
    from finefreeze._plan.plan import Plan

    plan = (_saved_freezing_optimizer(path) or {}).get("plan")
    return Plan.from_dict(plan, source=f"{path} (saved plan)") if plan else None


def optimizer_from_keras_file(path: str):
    """The optimizer a ``FreezingOptimizer`` in a ``.keras`` file wraps (AdamW, SGD, ...), new; or None."""
    inner = (_saved_freezing_optimizer(path) or {}).get("inner_optimizer")
    if not isinstance(inner, dict):
        return None
    import keras

    try:
        return keras.optimizers.deserialize(inner)
    except Exception:  # a custom optimizer this process does not know: the report assumes Adam
        return None


def load_plan(path: str | None, *, model_file: str | None = None, bundled: bool = True):
    """A plan from a file; else the plan saved in ``model_file``; else the bundled plan (no model file only)."""
    from finefreeze._plan.plan import Plan

    if path is not None:
        if not os.path.exists(path):
            raise UserError(f"plan file {path!r} does not exist")
        return Plan.load(path)
    if model_file is not None:
        saved = plan_from_keras_file(model_file)
        if saved is not None:
            return saved
    if not bundled or model_file is not None:
        raise UserError(f"{model_file!r} holds no finefreeze plan; pass --plan PLAN")
    from finefreeze._data.text_model import DEFAULT_PLAN

    return Plan.from_dict(DEFAULT_PLAN, source="bundled plan")


def _embedding_rows(model) -> int | None:
    """Rows of the smallest Embedding that reads the model's input directly, or None.

    Out-of-range ids are an error on TensorFlow and PyTorch at the first
    batch (a raw traceback) and silently clipped by JAX: checked up front.
    """
    import keras

    src = model.inputs[0] if getattr(model, "inputs", None) else None
    if src is None:
        return None
    dims = [
        layer.input_dim
        for layer in all_layers(model, include_self=False)
        if isinstance(layer, keras.layers.Embedding) and any(t is src for t in inbound_tensors(layer))
    ]
    return min(dims) if dims else None


def _shape_fits(want, got) -> bool:
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


def load_data(path: str | None, model) -> tuple[tuple, tuple]:
    """``((x, y), (x_val, y_val))`` from an ``.npz`` file, checked against ``model``.

    The file holds ``x`` and ``y``, optionally ``x_val`` and ``y_val`` (else
    the last 10 % of ``x``/``y`` validate). None: the bundled data.
    """
    if path is None:
        from finefreeze._data.text_model import make_data

        return make_data(2048, new_tokens=True, seed=0), make_data(512, new_tokens=True, seed=1)
    if not os.path.exists(path):
        raise UserError(f"data file {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise UserError(f"cannot read data file {path!r} ({type(e).__name__}); write it with numpy.savez") from None
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise UserError(f"data file {path!r} must hold arrays 'x' and 'y' (found: {', '.join(arrays) or 'none'})")
    pairs = {"x": (arrays["x"], arrays["y"])}
    if "x_val" in arrays and "y_val" in arrays:
        pairs["x_val"] = (arrays["x_val"], arrays["y_val"])
    in_shape, out_shape = tuple(model.inputs[0].shape), tuple(model.outputs[0].shape)
    for name, (a, b) in pairs.items():
        yname = "y" + name[1:]
        if len(a) != len(b):
            raise UserError(f"data file {path!r}: {name} has {len(a)} rows but {yname} has {len(b)}; they must match")
        if len(a) < (1 if name == "x_val" or "x_val" in pairs else 2):
            raise UserError(f"data file {path!r}: {name} has too few rows ({len(a)})")
        if not _shape_fits(in_shape, (None,) + a.shape[1:]):
            raise UserError(
                f"data file {path!r}: {name} has shape {a.shape} but the model takes inputs of shape {in_shape}"
            )
        rows = _embedding_rows(model) if np.issubdtype(a.dtype, np.integer) and a.size else None
        if rows is not None and (a.min() < 0 or a.max() >= rows):
            raise UserError(
                f"data file {path!r}: {name} holds ids over [{a.min()}, {a.max()}] but the model's embedding "
                f"has {rows} rows (ids 0..{rows - 1}); extend the vocabulary or map the ids"
            )
        sparse = np.issubdtype(b.dtype, np.integer) and b.ndim == 1
        if sparse and (b.min() < 0 or b.max() >= out_shape[-1]):
            raise UserError(
                f"data file {path!r}: labels {yname} range over [{b.min()}, {b.max()}] but the model has "
                f"{out_shape[-1]} outputs"
            )
        if not sparse and not _shape_fits(out_shape, (None,) + b.shape[1:]):
            raise UserError(
                f"data file {path!r}: {yname} has shape {b.shape} but the model outputs {out_shape} "
                "(give integer class labels of shape (n,) or targets shaped like the output)"
            )
    x, y = pairs["x"]
    if "x_val" in pairs:
        val = pairs["x_val"]
    else:
        cut = max(1, len(x) // 10)
        x, y, val = x[:-cut], y[:-cut], (x[-cut:], y[-cut:])
    return (x, y), val


def data_kind(model_path: str | None) -> str:
    """What ``--data`` a model takes, for messages."""
    if is_causal_preset(model_path):
        return (
            "a corpus: a .txt file (one example per line) or a .jsonl file (objects with 'text', or 'prompt' and "
            "'response'), for a causal LM's preset folder"
        )
    if is_preset(model_path):
        return "text data: a .csv with columns text,label, or a .jsonl, for a KerasHub preset folder"
    return "DATA.npz with arrays x and y, for a .keras model"


def training_inputs(model_path: str | None, data: str | None, *, sequence_length: int = 128):
    """``(model, (x, y), (x_val, y_val))`` for a run: a ``.keras`` file (or the bundled model) and its
    ``.npz`` data, or a preset's text classifier and its tokenised text data; a preset's causal LM and its
    tokenised corpus with the targets' weights, ``(x, y, w)``."""
    if is_causal_preset(model_path):
        return causal_task(model_path, data, sequence_length=sequence_length)
    if is_preset(model_path):
        model, train, val, _ = text_task(model_path, data, sequence_length=sequence_length)
        return model, train, val
    model = load_model(model_path)
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise UserError("finetune takes models with one input and one output; use the Python API for others")
    train, val = load_data(data, model)
    return model, train, val
