"""The ``finefreeze`` command line: ``finetune``, ``inspect``, ``verify``, ``delta``, ``generate``.

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

from finefreeze._cli import parser
from finefreeze._cli.deltas import cmd_delta_apply, cmd_delta_export
from finefreeze._cli.inputs import (
    base_model,
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
    catch_interrupts,
    check_interrupt,
    exit_code,
    finished,
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
        sequence_length=args.sequence_length, plan_written=args.select is not None, quantize=args.quantize,
    )  # fmt: skip
    from finefreeze._cli.finetune import finetune
    from finefreeze._report.events import require_tensorboard

    require_tensorboard("finefreeze finetune")  # before --select's slow work
    with tempfile.TemporaryDirectory() as scratch:  # nothing lands in --out before finetune's own checks
        plan = args.plan
        if args.select is not None:  # choose the plan from the training data first
            from finefreeze._cli.selectfile import select_to_file

            budget = "1%" if args.budget is None else args.budget
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
            prompt=args.prompt,
            quantize=args.quantize,
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
    from finefreeze._cli.quantize import quantize_as, quantized_kernels
    from finefreeze._errors import FrozenValueChanged
    from finefreeze._freezer.freezer import Freezer

    plan = load_plan(args.plan, model_file=args.tuned, bundled=False)
    tuned = load_model(args.tuned)
    base = base_model(args.base, task_of(tuned))
    quantize_as(base, quantized_kernels(tuned), repr(args.tuned))  # a quantized run's: the same integers
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


def cmd_generate(args) -> int:
    from finefreeze._cli.generate import check_generate, generate

    check_generate(args.model, delta=args.delta, max_length=args.max_length)  # before a framework loads
    text = generate(args.model, args.prompt, delta=args.delta, max_length=args.max_length)
    print(text)
    finished()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command (:mod:`finefreeze._cli.parser`), bound to the handlers here."""
    return parser.build_parser(
        {
            "finetune": cmd_finetune,
            "inspect": cmd_inspect,
            "verify": cmd_verify,
            "delta export": cmd_delta_export,
            "delta apply": cmd_delta_apply,
            "generate": cmd_generate,
        }
    )


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
    name = "finefreeze"
    try:
        quiet_tensorflow()  # inside the try: a signal the console script caught early is the interrupt
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
