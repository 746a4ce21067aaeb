"""``finefreeze delta export`` and ``delta apply``: a tuned model's delta, and a model rebuilt from deltas.

Without ``-o`` each writes into the run folder, the folder of its input
(``TUNED``, or the first ``DELTA``), under a fixed name
(:data:`~finefreeze._cli.parser.EXPORTED`, :data:`~finefreeze._cli.parser.REBUILT`).
``delta apply`` saves the model compiled with a ``FreezingOptimizer`` of the
plan the deltas were trained under, as ``finetune`` saves ``tuned.keras``:
``finefreeze verify BASE OUT`` then checks every element the deltas leave
frozen. Nothing here imports a framework before the inputs are checked.
"""

from __future__ import annotations

import os
import shlex

import numpy as np

from finefreeze._cli.inputs import base_model, check_model_file, load_model, load_plan
from finefreeze._cli.parser import EXPORTED, REBUILT
from finefreeze._cli.presets import is_causal_preset
from finefreeze._cli.quantize import quantize_as, refuse_trained_deltas
from finefreeze._files.atomic import UserError, atomic_path, check_output, refuse_overwrite

__all__ = ["cmd_delta_export", "cmd_delta_apply", "freezer_of_deltas"]


def _beside(path: str, name: str) -> str:
    """``name`` in the folder of ``path`` (the run folder)."""
    return os.path.join(os.path.dirname(path), name)


def cmd_delta_export(args) -> int:
    out = args.out if args.out is not None else _beside(args.tuned, EXPORTED)
    check_model_file(args.tuned)
    refuse_overwrite([out], [args.tuned, args.plan], "delta export")
    if args.plan is not None and not os.path.exists(args.plan):
        raise UserError(f"plan file {args.plan!r} does not exist")
    check_output(out, force=args.force)
    from finefreeze._freezer.freezer import Freezer

    plan = load_plan(args.plan, model_file=args.tuned, bundled=False)
    model = load_model(args.tuned)
    frz = Freezer(model, plan)
    # a quantized run's deltas are not in its .keras file: an export would write them as zeros
    zeros = "an export would write zeros; the run's delta file is delta.safetensors"
    refuse_trained_deltas(frz._res, args.tuned, zeros)
    with atomic_path(out, force=args.force) as tmp:
        info = frz.save_delta(tmp)
    print(f"wrote {out}: {info['tensors']} tensors, {info['bytes']:,} bytes")
    return 0


def cmd_delta_apply(args) -> int:
    out = args.out if args.out is not None else _beside(args.delta[0], REBUILT)
    if not str(out).endswith(".keras"):
        raise UserError(f"-o/--out {out!r}: delta apply writes a Keras model file; give a name ending in .keras")
    check_model_file(args.base, preset=True)
    refuse_overwrite([out], [args.base, *args.delta], "delta apply")
    for d in args.delta:
        if not os.path.exists(d):
            raise UserError(f"delta file {d!r} does not exist")
    if len(set(map(os.path.abspath, args.delta))) < len(args.delta):
        raise UserError("a delta file is named twice; give each once")
    check_output(out, force=args.force)
    import keras

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
    _refuse_quantized(named, args.base)
    with atomic_path(out, force=args.force) as tmp:
        model = base_model(args.base, deltafile.read_json(args.delta[0], "base"))
        # the quantized kernels a delta leaves frozen (it trained float weights beside them): quantized alike
        quantize_as(model, {p: e.quantized for p, e in entries.items() if e.quantized is not None}, args.delta[0])
        try:
            bound = bind(model, entries, " + ".join(repr(d) for d in args.delta))
            apply_bound(bound)
        except (DeltaError, WriteFailed) as e:
            raise UserError(str(e)) from None
        recorded = deltafile.read_json(args.delta[0], "plan") if len(args.delta) == 1 else None
        at = {id(b.entry): b.variable.path for b in bound}  # the model's own paths (a loaded Sequential drops its name)
        frz = freezer_of_deltas(model, {at.get(id(e), p): e for p, e in entries.items()}, recorded)
        # the delta does not say which optimizer trained it: Keras' Adam, for whoever trains OUT further
        model.compile(optimizer=frz.wrap(keras.optimizers.Adam()))
        model.optimizer.build(model.trainable_variables)  # its state saved with it: the file loads without warnings
        model.save(tmp)
    n = sum(b.entry.elements for b in bound)
    print(
        f"wrote {out}: {n:,} elements in {len(bound)} variables from {', '.join(args.delta)}; "
        f"check: finefreeze verify {shlex.quote(args.base)} {shlex.quote(out)}"
    )
    return 0


def _refuse_quantized(named: list, base: str) -> None:
    """Raise :class:`UserError` for a delta trained on a quantized base: a ``.keras`` file cannot hold it."""
    for d, entries in named:
        modes = sorted({e.quantized for e in entries.values() if e.quantized is not None and e.values is not None})
        if modes:
            if is_causal_preset(base):
                where = f"finefreeze generate {shlex.quote(base)} PROMPT --delta {shlex.quote(d)}"
            else:  # the run's tuned.keras is the base quantized the same way
                tuned = os.path.join(os.path.dirname(d), "tuned.keras")
                where = f"ff.load_delta(keras.models.load_model({tuned!r}), {d!r})"
            raise UserError(
                f"delta {d!r} was trained on {base!r} quantized to {'/'.join(modes)}: its kernels' trained values "
                "are float deltas beside their integers, which a .keras file does not hold (Keras saves a quantized "
                f"layer's integers only). Apply it where it runs: {where}"
            )


def freezer_of_deltas(model, entries: dict, recorded: dict | None):
    """A ``Freezer`` on ``model`` whose plan trains exactly the elements ``entries`` write.

    The plan a delta records (``recorded``, one delta) when it resolves on
    ``model`` to exactly those elements, its rules and ``lr_scale`` kept;
    otherwise (several deltas, no plan recorded) a plan made from the
    entries: ``freeze("**")``, then ``train`` each written variable, whole or
    by a mask of its written elements.
    """
    from finefreeze._errors import PlanError
    from finefreeze._freezer.freezer import Freezer
    from finefreeze._plan.plan import Plan

    if isinstance(recorded, dict):
        try:
            frz = Freezer(model, Plan.from_dict(recorded, source="the delta's plan"))
        except PlanError:
            frz = None
        if frz is not None and _trains_exactly(frz, entries):
            return frz
    return Freezer(model, _plan_from_entries(entries))


def _trains_exactly(frz, entries: dict) -> bool:
    """Whether ``frz`` trains the elements ``entries`` write and no other."""
    from finefreeze._errors import PlanError

    written = 0
    for p, e in entries.items():
        try:
            state = frz.variable_state(p)
        except PlanError:
            return False
        if state != e.kind:
            return False
        if state == "partial" and not np.array_equal(np.flatnonzero(~frz.frozen_mask(p)), e.index):
            return False
        written += e.elements if state in ("trainable", "partial") else 0
    return frz.report()["totals"]["trainable_elements"] == written


def _plan_from_entries(entries: dict):
    from finefreeze._plan.plan import Plan
    from finefreeze._plan.rules import freeze, train
    from finefreeze._select.select import rule_selector

    rules = [freeze("**")]
    for p, e in entries.items():
        if e.values is None or e.kind == "untrained":  # frozen; or Keras' own (moving statistics): outside plans
            continue
        if e.index is None:
            rules.append(train(rule_selector(p)))
        else:
            mask = np.zeros(int(np.prod(e.shape, dtype=np.int64)), bool)
            mask[e.index] = True
            rules.append(train(rule_selector(p), mask=mask.reshape(e.shape)))
    return Plan(rules)
