"""``finefreeze finetune --select SCORE --budget B``: choose the plan from data, write it to a file."""

from __future__ import annotations

import os
import sys
import warnings

from finefreeze._backends.randomness import set_seed
from finefreeze._cli.causal import is_causal_lm
from finefreeze._cli.finetune import UserError, loss_for
from finefreeze._cli.inputs import data_kind, training_inputs
from finefreeze._cli.presets import new_head
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._select.scores import SCORES, next_token_loss, next_token_targets
from finefreeze._select.select import select

__all__ = ["select_to_file", "SCORES"]


def _budget(text: str) -> float | int | str:
    """``--budget`` as :func:`finefreeze.select` takes it: an int count, a float fraction or a percent string."""
    if text.strip().endswith("%"):
        return text  # select checks it
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise UserError(
            f"--budget {text!r}: give a fraction such as 0.01, a percent such as 1% or a count of elements such as 5000"
        ) from None


def select_to_file(
    model_path: str | None, data_path: str | None, *, score: str, budget: str, out: str, sequence_length: int = 128
) -> str:
    """Run :func:`finefreeze.select` on the model and training data ``finetune`` will use; return the plan file.

    The plan (``out/selected-plan.json``) trains the ``budget`` elements with
    the highest ``score`` on the training data; ``finetune`` then reads it as
    its ``--plan``.

    Raises:
        UserError: a bad budget, or a selection the model or data refuse
            (the command prints one line and exits 2).
    """
    if model_path is not None and not os.path.exists(model_path):
        raise UserError(f"model file {model_path!r} does not exist")
    if model_path is not None and data_path is None:
        raise UserError(f"--data is required with a model ({data_kind(model_path)})")
    b = _budget(budget)

    set_seed(0)  # a preset's new head as finetune makes it: the same command, the same plan
    model, train, _ = training_inputs(model_path, data_path, sequence_length=sequence_length)
    spread = {}
    if is_causal_lm(model):  # the next-token loss on the tokens training counts (not padding, not prompts)
        (x, y), loss = (train[0], next_token_targets(train[1], train[2])), next_token_loss()
        # docs/llm.md's recipe: the token table left out, the budget spread over every kind of projection
        spread = dict(exclude="**/token_embedding/**", spread="kind")
    else:
        (x, y), (loss, _) = train, loss_for(model, train[1])
    head = new_head(model)  # a preset's new head always trains: it starts random, and a delta must carry it
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", FreezeWarning)
            plan = select(
                model, (x, y), budget=b, score=score, loss=loss, include=head or None, options={"verbose": 0}, **spread
            )
    except PlanError as e:
        raise UserError(f"--select {score} --budget {budget}: {e}") from None
    for w in said:  # a count that looks like a percent, say: one line, as the command's own errors
        if issubclass(w.category, FreezeWarning):
            print(f"finefreeze finetune: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "selected-plan.json")
    plan.save(path)
    return path
