"""The ``finefreeze`` command line: ``finetune``, ``inspect``, ``verify``, ``delta``.

Exit codes: 0 ok, 1 verification failed, 2 bad input or environment (one
line on stderr, no traceback; OS errors included), 130 interrupted by Ctrl-C and
143 by SIGTERM (one
line, no traceback, no stray files). Every command has ``--help``, which
imports neither TensorFlow nor Keras. Every command runs on the Keras
backend ``KERAS_BACKEND`` names (TensorFlow, JAX or PyTorch); TensorFlow's
logging is quieted first, as Keras imports it when it is installed (the
backend, or ``model.save`` on the others).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from finefreeze._cli.inputs import (
    check_model_file,
    load_model,
    load_plan,
    optimizer_from_keras_file,
    plan_from_keras_file,
)
from finefreeze._cli.quiet import quiet_tensorflow
from finefreeze._files.atomic import (
    Terminated,
    UserError,
    atomic_path,
    catch_interrupts,
    check_interrupt,
    check_output,
    exit_code,
    finished,
    refuse_overwrite,
)

__all__ = ["main", "build_parser"]


def _bundled_model():
    from finefreeze._data.text_model import build_text_model

    return build_text_model()


def cmd_finetune(args) -> int:
    from finefreeze._cli.checks import check_finetune

    if args.budget is not None and args.select is None:
        raise UserError("--budget goes with --select SCORE (it is the size of the selection)")
    if args.select is not None and args.plan is not None:
        raise UserError("--select and --plan exclude each other: --select writes the plan")
    check_finetune(  # every refusal before a framework loads
        args.model, data=args.data, plan=args.plan, optimizer=args.optimizer, lr=args.lr, epochs=args.epochs,
        batch_size=args.batch_size, strategy=args.strategy, out=args.out, force=args.force, resume=args.resume,
        sequence_length=args.sequence_length, plan_written=args.select is not None,
    )  # fmt: skip
    from finefreeze._cli.finetune import finetune
    from finefreeze._report.events import require_tensorboard

    require_tensorboard("finefreeze finetune")  # before --select's slow work
    with tempfile.TemporaryDirectory() as scratch:  # nothing lands in --out before finetune's own checks
        plan = args.plan
        if args.select is not None:  # choose the plan from the training data first
            from finefreeze._cli.selectfile import select_to_file

            budget = "0.01" if args.budget is None else args.budget
            plan = select_to_file(
                args.model,
                args.data,
                score=args.select,
                budget=budget,
                out=scratch,
                sequence_length=args.sequence_length,
            )
        result = finetune(
            args.model,
            data=args.data,
            plan=plan,
            optimizer=args.optimizer,
            lr=args.lr,
            epochs=args.epochs,
            batch_size=args.batch_size,
            strategy=args.strategy,
            out=args.out,
            force=args.force,
            verbose=0 if args.quiet else 1,
            print_fn=(lambda *a, **k: None) if args.quiet else print,
            selected=args.select is not None,
            resume=args.resume,
            sequence_length=args.sequence_length,
        )
    print(result.line())
    return 0 if result.verified else 1


def cmd_inspect(args) -> int:
    if args.model is not None:
        check_model_file(args.model, preset=True)
    if args.plan is not None and not os.path.exists(args.plan):
        raise UserError(f"plan file {args.plan!r} does not exist")
    from finefreeze._freezer.freezer import Freezer
    from finefreeze._plan.plan import Plan

    if args.plan is None and args.model is not None and plan_from_keras_file(args.model) is None:
        plan = Plan([])  # no plan anywhere: the variables as Keras trains them
        if not args.json:
            print(
                f"{args.model} holds no finefreeze plan: every variable as Keras trains it (give one with --plan PLAN)"
            )
    else:
        plan = load_plan(args.plan, model_file=args.model)
    model = _bundled_model() if args.model is None else load_model(args.model, preset=True)
    frz = Freezer(model, plan)
    saved = optimizer_from_keras_file(args.model) if args.model is not None and not os.path.isdir(args.model) else None
    if saved is not None:
        frz.wrap(saved)  # the state column counts the saved optimizer's slots (AdamW, SGD, ...), not Adam's
    if args.json:
        print(json.dumps(frz.report(), indent=2))
    else:
        print(frz.summary(variables=not args.layers_only))
    finished()  # the report is out: a signal while the model is torn down changes nothing
    return 0


def _base_model(path: str, task: dict | None):
    """The model fine-tuning started from: a ``.keras`` file, or a preset folder (``task``: what was built on it)."""
    from finefreeze._cli.presets import base_from_preset, is_preset

    return base_from_preset(path, task) if is_preset(path) else load_model(path)


def cmd_verify(args) -> int:
    check_model_file(args.base, preset=True)
    check_model_file(args.tuned)
    if args.plan is not None and not os.path.exists(args.plan):
        raise UserError(f"plan file {args.plan!r} does not exist")
    if args.plan is None and plan_from_keras_file(args.tuned) is None and plan_from_keras_file(args.base) is not None:
        raise UserError(
            f"{args.tuned!r} holds no finefreeze plan but {args.base!r} does: the order is "
            f"`finefreeze verify BASE TUNED` (the model fine-tuning started from first); "
            f"did you mean `finefreeze verify {args.tuned} {args.base}`?"
        )
    from finefreeze._cli.presets import task_of
    from finefreeze._errors import FrozenValueChanged
    from finefreeze._freezer.freezer import Freezer

    plan = load_plan(args.plan, model_file=args.tuned, bundled=False)
    tuned = load_model(args.tuned)
    base = _base_model(args.base, task_of(tuned))
    frz = Freezer(tuned, plan)
    try:
        frz.verify(reference=base)
    except FrozenValueChanged as e:
        print(f"FAILED: frozen elements differ between {args.base} and {args.tuned}:")
        for path, where in e.violations:
            print(f"  {path}: {where}")
        finished()
        return 1
    t = frz.report()["totals"]
    print(f"OK: all {t['frozen_elements']:,} frozen elements of {args.tuned} are bit-identical to {args.base}")
    finished()
    return 0


def cmd_delta_export(args) -> int:
    check_model_file(args.tuned)
    refuse_overwrite([args.output], [args.tuned, args.plan], "delta export")
    if args.plan is not None and not os.path.exists(args.plan):
        raise UserError(f"plan file {args.plan!r} does not exist")
    check_output(args.output, force=args.force)
    from finefreeze._freezer.freezer import Freezer

    plan = load_plan(args.plan, model_file=args.tuned, bundled=False)
    with atomic_path(args.output, force=args.force) as tmp:
        frz = Freezer(load_model(args.tuned), plan)
        info = frz.save_delta(tmp)
    print(f"wrote {args.output}: {info['tensors']} tensors, {info['bytes']:,} bytes")
    return 0


def cmd_delta_apply(args) -> int:
    check_model_file(args.base, preset=True)
    refuse_overwrite([args.output], [args.base, *args.delta], "delta apply")
    for d in args.delta:
        if not os.path.exists(d):
            raise UserError(f"delta file {d!r} does not exist")
    if len(set(map(os.path.abspath, args.delta))) < len(args.delta):
        raise UserError("a delta file is named twice; give each once")
    check_output(args.output, force=args.force)
    from finefreeze._errors import DeltaError
    from finefreeze._files import deltafile
    from finefreeze._files.entries import bind, read_entries
    from finefreeze._files.merge import merge_entries
    from finefreeze._files.switch import WriteFailed, apply_bound

    try:
        named = [(d, read_entries(d)) for d in args.delta]
        entries = merge_entries(named) if len(named) > 1 else named[0][1]
    except DeltaError as e:
        raise UserError(str(e).removeprefix("merge_deltas: ")) from None
    with atomic_path(args.output, force=args.force) as tmp:
        model = _base_model(args.base, deltafile.read_json(args.delta[0], "base"))
        try:
            bound = bind(model, entries, " + ".join(repr(d) for d in args.delta))
            apply_bound(bound)
        except (DeltaError, WriteFailed) as e:
            raise UserError(str(e)) from None
        model.save(tmp)
    n = sum(b.entry.elements for b in bound)
    print(f"wrote {args.output}: {n:,} elements in {len(bound)} variables from {', '.join(args.delta)}")
    return 0


_MODEL_HELP = "a .keras model (default: the bundled text model)"
_PRESET_HELP = (
    "a .keras model, or a KerasHub preset folder (save_to_preset, or a Hugging Face checkpoint folder "
    "KerasHub converts); default: the bundled text model"
)
_PLAN_HELP = "plan file (.json, .toml, .yaml); default: the plan saved in {}"


def _command(sub, name: str, fn, help: str, description: str) -> argparse.ArgumentParser:
    """One subcommand: its parser, help line, description and handler."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(fn=fn)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    p = argparse.ArgumentParser(prog="finefreeze", description="Freeze any part of a Keras model, exactly.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ft = _command(
        sub,
        "finetune",
        cmd_finetune,
        "fine-tune a model under a plan (bundled example by default)",
        "Fine-tune MODEL under PLAN, verify that every frozen element is bit-identical, and write "
        "tuned.keras, delta.safetensors, report.json, a TensorBoard log and frozen.png to --out. "
        "MODEL may be a KerasHub preset folder with text data (--data texts.csv). "
        "With no MODEL: a bundled pretrained text model extended with new tokens, its data, and a "
        "plan that trains only the new embedding rows and the head.",
    )
    ft.add_argument("model", nargs="?", help=_PRESET_HELP)
    ft.add_argument(
        "--data",
        help="required with MODEL: .npz with x, y (optional x_val, y_val) for a .keras model; "
        ".csv (columns text,label) or .jsonl for a preset, whose model is then a text classifier",
    )
    ft.add_argument("--plan", help=_PLAN_HELP.format("MODEL, or the bundled plan"))
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
    ft.add_argument("--out", default="finefreeze-out", help="output directory (default: ./finefreeze-out)")
    ft.add_argument("--force", action="store_true", help="replace the files of a previous run in --out")
    ft.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --out from its last finished epoch (same command line otherwise)",
    )
    ft.add_argument("-q", "--quiet", action="store_true", help="print only the final line")
    ft.add_argument(
        "--select",
        choices=["fisher", "gradient", "magnitude", "delta", "random"],
        help="choose the trained elements from the training data with this score (ff.select) instead of --plan",
    )
    ft.add_argument(
        "--budget", default=None, help="with --select: a fraction (0.01) or a count of elements (default: 0.01)"
    )

    ins = _command(
        sub,
        "inspect",
        cmd_inspect,
        "show what a plan freezes, without training",
        "Print the freeze summary of MODEL under PLAN (bundled example by default).",
    )
    ins.add_argument("model", nargs="?", help=_PRESET_HELP)
    ins.add_argument("--plan", help=_PLAN_HELP.format("MODEL, or the bundled plan"))
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("--layers-only", action="store_true", help="one row per layer")

    ver = _command(
        sub,
        "verify",
        cmd_verify,
        "check that a fine-tune left every frozen element bit-identical",
        "Exit 0 when every element PLAN freezes is bit-identical in BASE and TUNED, 1 otherwise.",
    )
    ver.add_argument("base", help="the .keras model or KerasHub preset folder fine-tuning started from")
    ver.add_argument("tuned", help="the fine-tuned .keras model")
    ver.add_argument("--plan", help=_PLAN_HELP.format("TUNED"))

    dl = sub.add_parser("delta", help="export or apply a delta file", description="Delta files (safetensors).")
    dsub = dl.add_subparsers(dest="delta_command", required=True, metavar="ACTION")
    ex = _command(
        dsub,
        "export",
        cmd_delta_export,
        "write what TUNED trained to a delta file",
        "Write the trainable elements of TUNED under PLAN to a .safetensors delta.",
    )
    ex.add_argument("tuned", help="the fine-tuned .keras model")
    ex.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    ex.add_argument("--plan", help=_PLAN_HELP.format("TUNED"))
    ex.add_argument("--force", action="store_true", help="replace an existing output file")
    ap = _command(
        dsub,
        "apply",
        cmd_delta_apply,
        "apply delta files to their base model",
        "Apply DELTA to BASE (refused if BASE's frozen part differs) and save the result. Several deltas "
        "trained on disjoint elements of BASE combine (as merge_deltas); overlapping ones are refused.",
    )
    ap.add_argument("base", help="the .keras base model, or the KerasHub preset folder fine-tuning started from")
    ap.add_argument("delta", nargs="+", help="one or more .safetensors deltas of BASE")
    ap.add_argument("-o", "--output", required=True, help="the .keras file to write")
    ap.add_argument("--force", action="store_true", help="replace an existing output file")
    return p


def _os_error(e: OSError) -> str:
    where = f" {e.filename!r}" if e.filename else ""
    return f"{e.strerror or e}{':' if where else ''}{where}"


_BACKEND_MODULES = frozenset({"tensorflow", "jax", "torch"})


def _backend_hint(e: Exception) -> str:
    """What to do when the Keras backend cannot be loaded ('' for other errors)."""
    missing = (getattr(e, "name", None) or "").split(".")[0]
    if not str(e).startswith("Unable to import backend") and missing not in _BACKEND_MODULES:
        return ""
    import importlib.util

    chosen = os.environ.get("KERAS_BACKEND", "tensorflow (Keras' default, or ~/.keras/keras.json)")
    failed = os.environ.get("KERAS_BACKEND", "tensorflow")

    def findable(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    installed = [b for b in ("tensorflow", "jax", "torch") if b != failed and findable(b)]
    if installed:
        fix = " or ".join(f"KERAS_BACKEND={b}" for b in installed)
        return f" (the Keras backend is KERAS_BACKEND={chosen}, which cannot load; installed here: {fix})"
    return (
        f" (the Keras backend is KERAS_BACKEND={chosen}: no backend is installed; "
        "pip install 'finefreeze[cpu]' (TensorFlow), 'finefreeze[jax]' or 'finefreeze[torch]')"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``finefreeze`` command; returns the exit code (0, 1, 2, 130 or 143).

    With ``argv`` None the command is the whole process (the console
    script): once it is done, Ctrl-C and SIGTERM are ignored, so the exit
    status stays what the command returned.
    """
    quiet_tensorflow()
    name = "finefreeze"
    try:
        with catch_interrupts(own_process=argv is None):
            args = build_parser().parse_args(argv)
            name += f" {args.command}" + (f" {args.delta_command}" if args.command == "delta" else "")
            from finefreeze._errors import DeltaError, PlanError

            try:
                code = args.fn(args)
            except (UserError, PlanError, DeltaError, ImportError) as e:
                check_interrupt()  # an error caused by the interrupt is the interrupt
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"{name}: error: {first}{_backend_hint(e)}", file=sys.stderr)
                return 2
            except ValueError as e:
                if not str(e).startswith("Unable to import backend"):
                    raise
                print(f"{name}: error: {e}{_backend_hint(e)}", file=sys.stderr)
                return 2
            except BrokenPipeError:  # the reader went away (`finefreeze inspect | head`): nothing to say
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 141
            except OSError as e:
                check_interrupt()
                print(f"{name}: error: {_os_error(e)}", file=sys.stderr)
                return 2
            except Exception:
                check_interrupt()  # whatever a signal broke on its way in is the interrupt, not a traceback
                raise
            check_interrupt()
            return code
    except KeyboardInterrupt as e:
        how = " by SIGTERM" if isinstance(e, Terminated) else ""
        more = "".join(f"; {n}" for n in getattr(e, "__notes__", ()))
        print(f"{name}: interrupted{how}; no file was left half-written{more}", file=sys.stderr)
        code = 143 if isinstance(e, Terminated) else exit_code()
        if argv is None:  # the whole process: end it now; TensorFlow's threads, stopped mid-batch, may crash at exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
