"""The main job: fine-tune a model under a plan, verify it, and ship a delta.

``finefreeze finetune`` is a thin argument parser over :func:`finetune`.
With no model it runs on the bundled example: a small text model pretrained
on a generated task, extended with new tokens, fine-tuned on data that needs
them, under a plan that trains only the new embedding rows and the head.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from typing import Any

import numpy as np

from finefreeze._backends.randomness import set_seed
from finefreeze._cli.causal import default_plan, generate_text, is_causal_lm, lm_loss, perplexity
from finefreeze._cli.checks import OUTPUTS, RESUME, check_finetune, done_epochs, file_digest
from finefreeze._cli.epochs import plain, seed_states, shuffled, stop_on_interrupt
from finefreeze._cli.inputs import data_kind, load_plan, training_inputs
from finefreeze._cli.presets import is_causal_preset
from finefreeze._cli.quantize import quantize_base
from finefreeze._cli.result import Result
from finefreeze._files.atomic import (
    Staging,
    Terminated,
    UserError,
    check_interrupt,
    interrupted,
    interrupts_at_checks,
)
from finefreeze._files.delta import save_delta
from finefreeze._keras.instances import tag

__all__ = ["finetune", "Result", "OUTPUTS", "RESUME", "training_inputs", "data_kind"]  # the last two from inputs


def loss_for(model, y):
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


def _metric(model, val, batch_size: int, name: str) -> float:
    """``name`` (a compiled metric, or the loss) on the validation data."""
    got = plain(model, "evaluate")(
        val[0], val[1], batch_size=batch_size, verbose=0, return_dict=True, callbacks=[stop_on_interrupt()]
    )
    return float(got[name])


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
    force: bool = False,
    verbose: int = 1,
    print_fn=print,
    selected: bool = False,
    resume: bool = False,
    sequence_length: int = 128,
    prompt: str | None = None,
    quantize: str | None = None,
) -> Result:
    """Fine-tune under a plan; write the model, delta, report, TensorBoard log and picture.

    Every input is checked before the first slow step; every output is
    written in a hidden folder inside ``out`` and renamed into place at the
    end, so an error or an interrupt leaves ``out`` as it was, apart from
    the resume point: after every epoch the run saves its state in
    ``out/.finefreeze-resume``, and ``resume=True`` (``--resume``) continues
    an interrupted run from its last finished epoch, bit-identical to an
    uninterrupted one. Staging folders of killed runs are removed.

    ``model_path`` may be a KerasHub preset folder (or a Hugging Face
    checkpoint folder KerasHub converts): ``data`` is then a CSV or JSONL
    file of ``text,label`` rows, and the model a text classifier from the
    preset with one output per label, its texts cut to ``sequence_length``
    tokens. A preset of a KerasHub causal LM fine-tunes on a corpus
    (:mod:`finefreeze._cli.causal`) under ``plan`` or, without one, its
    default plan; the metric is the validation perplexity, and the report
    holds greedy text from ``prompt`` (default: the first words of the first
    validation example) before and after.

    ``quantize`` (``"int8"``, ``"int4"``) quantizes the base with Keras before
    the plan applies (:func:`~finefreeze._cli.quantize.quantize_base`): what
    the plan trains of a quantized kernel is a float delta beside its
    integers, written to the delta file (``tuned.keras`` holds the quantized
    base and the float weights that trained).
    """
    from finefreeze._report.events import require_tensorboard

    settings = check_finetune(
        model_path, data=data, plan=plan, optimizer=optimizer, lr=lr, epochs=epochs, batch_size=batch_size,
        strategy=strategy, out=out, force=force, resume=resume, sequence_length=sequence_length, quantize=quantize,
    )  # fmt: skip
    require_tensorboard("finefreeze finetune")
    causal = plan is None and is_causal_preset(model_path)  # its default plan is made from the loaded model
    the_plan = None if causal else load_plan(plan, model_file=model_path)
    with Staging(out, OUTPUTS, force=force, inputs=(model_path, data, plan), marker="report.json") as stage:
        for name in stage.removed:
            print(
                f"finefreeze finetune: removed {os.path.join(out, name)}, left by a run that was killed "
                f"(process {name.rsplit('-', 1)[1]} is gone)",
                file=sys.stderr,
            )
        point = os.path.join(out, RESUME)
        try:  # from here on a signal may land anywhere, even between two lines: the resume point goes with it
            _resume_point(out, settings, resume)
            if selected:  # the plan --select chose is an output of this run
                shutil.copyfile(plan, stage.path("selected-plan.json"))
            what = "pretraining the bundled text model" if model_path is None else f"loading {model_path}"
            if resume:
                what += f", to resume after epoch {done_epochs(point)}"
            print_fn(f"finefreeze finetune: {what} ...", flush=True)
            result = _run(
                stage,
                point,
                (model_path, data, sequence_length, prompt, quantize),
                the_plan,
                optimizer,
                lr,
                epochs,
                batch_size,
                strategy,
                verbose,
                print_fn,
            )
        except KeyboardInterrupt as e:
            _interrupted_at(point, e)
            raise
        except Exception as e:
            if interrupted():  # an error the signal caused (a library turned it into its own): the interrupt
                stop = Terminated() if interrupted() == signal.SIGTERM else KeyboardInterrupt()
                _interrupted_at(point, stop)
                raise stop from e
            if not resume:  # an error, not an interrupt: there is nothing to resume
                shutil.rmtree(point, ignore_errors=True)
            raise
        shutil.rmtree(point, ignore_errors=True)  # the outputs are in place: nothing left to resume
        return result


def _interrupted_at(point: str, e: KeyboardInterrupt) -> None:
    """Keep the resume point if an epoch finished (the interrupt line then says how to go on), else remove it."""
    if not os.path.exists(os.path.join(point, "latest.weights.h5")):  # no epoch finished: nothing to resume
        shutil.rmtree(point, ignore_errors=True)
    else:
        e.add_note(f"rerun the same command with --resume to continue after epoch {done_epochs(point)}")


def _resume_point(out: str, settings: dict, resume: bool) -> str:
    """The folder of this run's resume point: kept when resuming, else made afresh with the settings."""
    folder = os.path.join(out, RESUME)
    if not resume:
        shutil.rmtree(folder, ignore_errors=True)  # --force: start over
        os.makedirs(folder)
        with open(os.path.join(folder, "settings.json"), "w") as f:
            json.dump(settings, f)
    return folder


def _terminal() -> bool:
    """Whether stdout is a terminal (Keras' progress bar writes cursor codes that a log file keeps)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _run(stage, point, inputs, the_plan, optimizer, lr, epochs, batch_size, strategy, verbose, print_fn):
    """Build, train, verify and write one run into ``stage``; its :class:`Result`."""
    import finefreeze as ff

    model_path, data, sequence_length, prompt, quantize = inputs
    opt = _optimizer(optimizer, lr)
    set_seed(0)  # a preset's new head: the same command makes the same model
    model, train, val = training_inputs(model_path, data, sequence_length=sequence_length)
    causal = is_causal_lm(model)
    if the_plan is None:  # a causal LM's preset without --plan
        the_plan = default_plan(model)
    if quantize is not None:  # the plan's kernels then train as float deltas beside the integers
        n, left = quantize_base(model, the_plan, quantize)
        print_fn(
            f"finefreeze finetune: quantized {n} layers to {quantize} (the plan's kernels train float deltas){left}"
        )
    set_seed(0)  # dropout and friends: the same command trains the same model
    frz = ff.Freezer(model, the_plan, strategy=strategy)
    files = {}
    if model_path is None:
        model.save(stage.path("base.keras"))
        files["base"] = os.path.join(stage.out, "base.keras")
    loss, metrics = (lm_loss(), []) if causal else loss_for(model, train[1])
    model.compile(optimizer=frz.wrap(opt), loss=loss, metrics=metrics)
    print_fn(frz.summary(variables=False))  # after wrap: its state column names the optimizer
    name = "perplexity" if causal else metrics[0] if metrics else "loss"

    def measure() -> float:
        with interrupts_at_checks():  # a signal stops the evaluation between two batches
            return perplexity(model, val, batch_size) if causal else _metric(model, val, batch_size, name)

    before = measure()
    sample = None
    if causal:  # greedy text from one prompt, before and after: what the numbers mean
        text = prompt if prompt is not None else tag(model, "_finefreeze_prompt")
        sample = {"prompt": text, "max_length": sequence_length, "before": generate_text(model, text, sequence_length)}
    first_epoch = done_epochs(point)
    hist = _train(stage, point, model, frz, train, val, epochs, batch_size, first_epoch, verbose)
    files["tensorboard"] = os.path.join(stage.out, "tensorboard")
    metric = {"name": f"val_{name}", "before": before, "after": measure()}
    if sample is not None:
        sample["after"] = generate_text(model, sample["prompt"], sequence_length)
        print_fn(
            f"finefreeze finetune: greedy text from {text!r}: {sample['before']!r} before, {sample['after']!r} after"
        )
    history = {k: [float(v) for v in vs] for k, vs in hist.history.items()}
    settings = {"optimizer": optimizer, "lr": lr, "epochs": epochs, "batch_size": batch_size, "quantize": quantize}
    if sample is not None:
        settings["sample"] = sample
    return _write(stage, model, frz, model_path, files, metric, history, settings, first_epoch, print_fn)


def _train(stage, point, model, frz, train, val, epochs, batch_size, first_epoch, verbose):
    """``fit`` from ``first_epoch`` with the resume point, the FreezeBoard and the interrupt check; its history."""
    import keras

    import finefreeze as ff

    board = ff.callbacks.FreezeBoard(stage.path("tensorboard"), frz)
    try:
        with interrupts_at_checks():  # a signal stops fit between two batches, never inside a step
            return plain(model, "fit")(
                shuffled(
                    train[0], train[1], batch_size, first_epoch, sample_weight=train[2] if len(train) > 2 else None
                ),
                validation_data=val,
                epochs=epochs,
                shuffle=False,  # the batches are shuffled already, the same way whatever epoch a run starts at
                verbose=2 if verbose == 1 and not _terminal() else verbose,  # a log gets one line per epoch
                callbacks=[
                    seed_states(model, point),  # before BackupAndRestore: its epoch's seeds are on disk first
                    keras.callbacks.BackupAndRestore(point, delete_checkpoint=False, double_checkpoint=True),
                    board,
                    stop_on_interrupt(),
                ],
            )
    finally:
        board.on_train_end()  # closes the event file even when fit is interrupted (idempotent)


def _write(stage, model, frz, model_path, files, metric, history, settings, first_epoch, print_fn) -> Result:
    """Verify, then write the tuned model, the delta, the picture and the report; commit the stage."""
    import finefreeze as ff

    out = stage.out
    try:
        frz.verify()
        verified, violations = True, []
    except ff.FrozenValueChanged as e:
        verified, violations = False, [list(v) for v in e.violations]
    check_interrupt()
    pre = tag(model, "_finefreeze_preprocessor", None)
    if pre is not None:  # a preset's task: saved with its preprocessor
        model.preprocessor = pre
    model.save(stage.path("tuned.keras"))
    files["model"] = os.path.join(out, "tuned.keras")
    check_interrupt()
    base = _base_record(model, model_path, out)
    delta = save_delta(frz, stage.path("delta.safetensors"), base=base)
    files["delta"] = os.path.join(out, "delta.safetensors")
    weights = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)
    try:
        frz.plot(stage.path("frozen.png"))
        files["picture"] = os.path.join(out, "frozen.png")
    except ImportError as e:
        print_fn(f"(picture skipped: {e})")
    rep = frz.report()
    files["report"] = os.path.join(out, "report.json")
    result = Result(
        out=out,
        trainable_elements=rep["totals"]["trainable_elements"],
        frozen_elements=rep["totals"]["frozen_elements"],
        verified=verified,
        delta_bytes=delta["bytes"],
        weights_bytes=weights,
        files=files,
        history=history,
        metric=metric,
        base=base["path"],
        sample=settings.get("sample"),
        quantized=settings.get("quantize"),
    )
    rep["finetune"] = {
        "verified": verified,
        "violations": violations,
        "metric": metric,
        "delta_bytes": delta["bytes"],
        "weights_bytes": weights,
        "files": files,
        "history": history,
        **settings,
        "resumed_after_epoch": first_epoch,  # history holds the epochs this run trained
        "labels": tag(model, "_finefreeze_labels", None),  # a preset's classes: output k is labels[k]
        "base": base,  # what fine-tuning started from: `finefreeze verify BASE tuned.keras` checks against it
    }
    with open(stage.path("report.json"), "w") as f:
        json.dump(rep, f, indent=2, default=_json_default)
    stage.commit()
    return result


def _base_record(model, model_path: str | None, out: str) -> dict:
    """What the run started from: the preset (path, sha256, the task built on it) or the ``.keras`` file."""
    record = tag(model, "_finefreeze_base", None)
    if record is not None:
        return {"path": record["preset"], **record}
    if model_path is None:  # the bundled model, written to --out
        return {"path": os.path.join(out, "base.keras")}
    return {"path": os.path.abspath(model_path), "sha256": file_digest(model_path)}


def _json_default(o: Any):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    return str(o)
