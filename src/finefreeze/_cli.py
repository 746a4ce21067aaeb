"""The ``finefreeze`` command line: ``inspect`` a model against a plan."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


class UserError(Exception):
    """A mistake in the command line or its files: exit 2, one line."""


def _quiet_tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _load_model(path):
    import keras

    if path is None:
        from finefreeze._example import build_text_model

        return build_text_model()
    if not os.path.exists(path):
        raise UserError(f"model file {path!r} does not exist")
    try:
        return keras.models.load_model(path, compile=False)
    except Exception as e:
        raise UserError(f"cannot load model {path!r}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def _load_plan(path):
    from finefreeze._plan import Plan

    if path is None:
        from finefreeze._example import DEFAULT_PLAN

        return Plan.from_dict(DEFAULT_PLAN, source="bundled plan")
    if not os.path.exists(path):
        raise UserError(f"plan file {path!r} does not exist")
    return Plan.load(path)


def cmd_inspect(args) -> int:
    from finefreeze._freezer import Freezer

    model = _load_model(args.model)
    frz = Freezer(model, _load_plan(args.plan))
    if args.json:
        print(json.dumps(frz.report(), indent=2))
    else:
        print(frz.summary(variables=not args.layers_only))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="finefreeze", description="Freeze any part of a Keras model, exactly.")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="show what a plan freezes, without training",
        description="Print the freeze summary of MODEL under PLAN (bundled example by default).",
    )
    ins.add_argument("model", nargs="?", help="a .keras model (default: the bundled text model)")
    ins.add_argument("--plan", help="plan file (.json, .toml, .yaml); default: the bundled plan")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.add_argument("--layers-only", action="store_true", help="one row per layer")
    ins.set_defaults(fn=cmd_inspect)
    return p


def main(argv=None) -> int:
    """Entry point of the ``finefreeze`` command; returns the exit code."""
    _quiet_tf()
    args = build_parser().parse_args(argv)
    from finefreeze._errors import PlanError

    try:
        return args.fn(args)
    except (UserError, PlanError) as e:
        first = str(e).strip().splitlines()[0]
        print(f"finefreeze {args.command}: error: {first}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"finefreeze {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
