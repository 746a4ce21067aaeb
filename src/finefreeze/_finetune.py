"""The main job: fine-tune a model under a plan, verify it, and ship a delta.

``finefreeze finetune`` is a thin argument parser over :func:`finetune`.
With no model it runs on the bundled example: a small text model pretrained
on a generated task, extended with new tokens, fine-tuned on data that needs
them, under a plan that trains only the new embedding rows and the head.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

__all__ = ["finetune", "UserError", "load_model", "load_plan", "load_data", "plan_from_keras_file"]


class UserError(Exception):
    """A mistake in the command line or its files: exit 2, one line."""


def load_model(path: str | None):
    """A Keras model from a ``.keras`` file (the bundled pretrained model for None)."""
    import keras

    if path is None:
        from finefreeze._example import pretrained_text_model

        return pretrained_text_model()
    if not os.path.exists(path):
        raise UserError(f"model file {path!r} does not exist")
    import finefreeze._example  # noqa: F401  (registers the bundled model's layers)

    try:
        return keras.models.load_model(path, compile=False)
    except Exception as e:
        raise UserError(f"cannot load model {path!r}: {type(e).__name__}: {str(e).strip().splitlines()[0]}") from None


def plan_from_keras_file(path: str):
    """The plan a ``FreezingOptimizer`` saved in a ``.keras`` file's compile config, or None."""
    import zipfile

    from finefreeze._plan import Plan

    try:
        with zipfile.ZipFile(path) as z:
            config = json.loads(z.read("config.json"))
    except (OSError, KeyError, zipfile.BadZipFile, ValueError):
        return None
    opt = (config.get("compile_config") or {}).get("optimizer")
    while isinstance(opt, dict):
        if opt.get("class_name") == "FreezingOptimizer":
            plan = opt.get("config", {}).get("plan")
            return Plan.from_dict(plan, source=f"{path} (saved plan)") if plan else None
        opt = opt.get("config", {}).get("inner_optimizer")
    return None


def load_plan(path: str | None, *, model_file: str | None = None, bundled: bool = True):
    """A plan from a file; else the plan saved in ``model_file``; else the bundled plan."""
    from finefreeze._plan import Plan

    if path is not None:
        if not os.path.exists(path):
            raise UserError(f"plan file {path!r} does not exist")
        return Plan.load(path)
    if model_file is not None:
        saved = plan_from_keras_file(model_file)
        if saved is not None:
            return saved
    if not bundled:
        raise UserError(f"{model_file!r} holds no finefreeze plan; pass --plan PLAN")
    from finefreeze._example import DEFAULT_PLAN

    return Plan.from_dict(DEFAULT_PLAN, source="bundled plan")


def _shape_fits(want, got) -> bool:
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


def load_data(path: str | None, model) -> tuple[tuple, tuple]:
    """``((x, y), (x_val, y_val))`` from an ``.npz`` file, checked against ``model``.

    The file holds ``x`` and ``y``, optionally ``x_val`` and ``y_val`` (else
    the last 10 % of ``x``/``y`` validate). None: the bundled data.
    """
    if path is None:
        from finefreeze._example import make_data

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


def _loss_for(model, y):
    import keras

    last = model.layers[-1]
    probs = getattr(getattr(last, "activation", None), "__name__", "") == "softmax"
    if np.issubdtype(y.dtype, np.integer) and y.ndim == 1:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=not probs), ["accuracy"]
    onehot = y.ndim == 2 and y.shape[1] > 1 and np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all()
    if onehot:
        return keras.losses.CategoricalCrossentropy(from_logits=not probs), ["accuracy"]
    return keras.losses.MeanSquaredError(), []


def _optimizer(name: str, lr: float):
    import keras

    try:
        opt = keras.optimizers.get(name)
    except (ValueError, TypeError):
        known = sorted(
            n.lower()
            for n in dir(keras.optimizers)
            if isinstance(getattr(keras.optimizers, n), type)
            and issubclass(getattr(keras.optimizers, n), keras.optimizers.Optimizer)
            and n not in ("Optimizer", "LossScaleOptimizer", "MultiOptimizer")
        )
        raise UserError(f"unknown optimizer {name!r}; choose one of {', '.join(known)}") from None
    opt.learning_rate = lr
    return opt


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

    def line(self) -> str:
        ok = "verify OK (every frozen element bit-identical)" if self.verified else "verify FAILED"
        return (
            f"finefreeze finetune: {self.trainable_elements:,} elements trained, {self.frozen_elements:,} frozen; "
            f"{ok}; delta {_kib(self.delta_bytes)} = {100 * self.delta_bytes / self.weights_bytes:.1f}% "
            f"of the {_kib(self.weights_bytes)} of weights; wrote {self.out}"
        )


def finetune(
    model_path: str | None = None,
    *,
    data: str | None = None,
    plan: str | None = None,
    optimizer: str = "adamw",
    lr: float = 5e-3,
    epochs: int = 4,
    batch_size: int = 64,
    strategy: str = "auto",
    out: str = "finefreeze-out",
    verbose: int = 1,
    print_fn=print,
) -> Result:
    """Fine-tune under a plan; write the model, delta, report, TensorBoard log and picture."""

    import finefreeze as ff

    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise UserError(f"--epochs ({epochs}), --batch-size ({batch_size}) and --lr ({lr}) must be positive")
    if model_path is not None and not os.path.exists(model_path):
        raise UserError(f"model file {model_path!r} does not exist")
    if model_path is not None and plan is None and plan_from_keras_file(model_path) is None:
        raise UserError(f"--plan PLAN is required with a model file ({model_path!r} holds no plan)")
    if model_path is not None and data is None:
        raise UserError("--data DATA.npz is required with a model file")
    the_plan = load_plan(plan, model_file=model_path)
    opt = _optimizer(optimizer, lr)
    model = load_model(model_path)
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise UserError("finetune takes models with one input and one output; use the Python API for others")
    (x, y), val = load_data(data, model)
    frz = ff.Freezer(model, the_plan, strategy=strategy)
    os.makedirs(out, exist_ok=True)
    files = {}
    if model_path is None:
        files["base"] = os.path.join(out, "base.keras")
        model.save(files["base"])
    print_fn(frz.summary(variables=False))
    loss, metrics = _loss_for(model, y)
    model.compile(optimizer=frz.wrap(opt), loss=loss, metrics=metrics)
    files["tensorboard"] = os.path.join(out, "tensorboard")
    board = ff.callbacks.FreezeBoard(files["tensorboard"], frz)
    hist = model.fit(
        x, y, validation_data=val, epochs=epochs, batch_size=batch_size, verbose=verbose, callbacks=[board]
    )
    try:
        frz.verify()
        verified, violations = True, []
    except ff.FrozenValueChanged as e:
        verified, violations = False, [list(v) for v in e.violations]
    files["model"] = os.path.join(out, "tuned.keras")
    model.save(files["model"])
    files["delta"] = os.path.join(out, "delta.safetensors")
    delta = frz.save_delta(files["delta"])
    weights = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)
    try:
        files["picture"] = frz.plot(os.path.join(out, "frozen.png"))
    except ImportError as e:
        print_fn(f"(picture skipped: {e})")
    rep = frz.report()
    t = rep["totals"]
    result = Result(
        out=out,
        trainable_elements=t["trainable_elements"],
        frozen_elements=t["frozen_elements"],
        verified=verified,
        delta_bytes=delta["bytes"],
        weights_bytes=weights,
        files=files,
        history={k: [float(v) for v in vs] for k, vs in hist.history.items()},
    )
    rep["finetune"] = {
        "verified": verified,
        "violations": violations,
        "delta_bytes": delta["bytes"],
        "weights_bytes": weights,
        "files": files,
        "history": result.history,
        "optimizer": optimizer,
        "lr": lr,
        "epochs": epochs,
        "batch_size": batch_size,
    }
    files["report"] = os.path.join(out, "report.json")
    with open(files["report"], "w") as f:
        json.dump(rep, f, indent=2, default=_json_default)
    return result


def _json_default(o: Any):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)
