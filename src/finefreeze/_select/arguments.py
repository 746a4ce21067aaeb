"""``select``'s arguments checked before any work: the budget, the ``options`` dict, the rest.

Every mistake is a :class:`~finefreeze.PlanError` that names the argument and
the rule it breaks; nothing is computed and the model is left as it was.
"""

from __future__ import annotations

import numbers
import re
import warnings
from decimal import Decimal
from typing import Any

import keras
import numpy as np

from finefreeze._backends.gradients import need_gradients
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._select.scores import DATA_SCORES, SCORES
from finefreeze._select.structure import STRUCTURES

__all__ = ["OPTIONS", "check_arguments", "check_budget", "check_options", "count_of"]

#: the knobs of ``select(..., options={...})`` and their defaults
OPTIONS: dict[str, Any] = {
    "largest": True,
    "microbatch": "auto",
    "per_example": "auto",
    "epochs": 1,
    "optimizer": None,
    "seed": 0,
    "verbose": 1,
}

_PER_EXAMPLE = ("auto", "vectorized", "loop")
_BUDGET_RULE = (
    'a budget is a fraction of the candidate elements (a float in (0, 1], or a percent such as "1%" or '
    '"0.5%") or a count of elements (an int >= 1)'
)
_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")
#: int budgets up to this look like a percent: they count elements, with a FreezeWarning
LOOKS_LIKE_PERCENT = 100


def _count(v: Any, least: int) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) and v >= least


#: per option: (whether a value is right, what a right value is)
_RULES = {
    "largest": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "microbatch": (lambda v: _count(v, 1) or (isinstance(v, str) and v == "auto"), 'an int >= 1 or "auto"'),
    "per_example": (lambda v: isinstance(v, str) and v in _PER_EXAMPLE, "'auto', 'vectorized' or 'loop'"),
    "epochs": (lambda v: _count(v, 1), "an int >= 1"),
    "optimizer": (lambda v: v is None or isinstance(v, keras.optimizers.Optimizer), "None or a Keras optimizer"),
    "seed": (lambda v: _count(v, 0), "an int >= 0"),
    "verbose": (lambda v: isinstance(v, (bool, np.bool_)) or (_count(v, 0) and v <= 2), "0, 1 or 2"),
}


def check_options(options: Any) -> dict[str, Any]:
    """Every option: the given ones (ints as Python ints) over the defaults of :data:`OPTIONS`.

    Raises:
        PlanError: ``options`` is not a dict, names an unknown key, or holds
            a value of the wrong type or range; the message names the key and
            lists the valid ones.
    """
    valid = ", ".join(OPTIONS)
    if options is None:
        return dict(OPTIONS)
    if not isinstance(options, dict):
        raise PlanError(f"select: options must be a dict of some of {valid}; got {type(options).__name__} {options!r}.")
    for key, value in options.items():
        if key not in OPTIONS:
            raise PlanError(f"select: options has an unknown key {key!r}; the valid keys are {valid}.")
        right, what = _RULES[key]
        if not right(value):
            raise PlanError(
                f"select: options[{key!r}] must be {what}; got {value!r} ({type(value).__name__}). "
                f"The valid keys are {valid}."
            )
    out = {**OPTIONS, **options}
    for key in ("microbatch", "epochs", "seed", "verbose"):
        if isinstance(out[key], numbers.Integral):
            out[key] = int(out[key])
    out["largest"] = bool(out["largest"])
    return out


def check_budget(budget: Any) -> tuple[str, float | int]:
    """``("count", n)`` or ``("fraction", f)`` for a budget of the right form.

    Raises:
        PlanError: a bool, a count below 1, a float outside (0, 1] (NaN
            included), a string that is not a percent in (0, 100], or another
            type; the message states the rule.
    """
    if isinstance(budget, (bool, np.bool_)):
        raise PlanError(f"select: budget={budget!r} is a bool; {_BUDGET_RULE}.")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise PlanError(f"select: budget={budget!r} selects nothing; {_BUDGET_RULE}.")
        return "count", int(budget)
    if isinstance(budget, numbers.Real):
        f = float(budget)
        if not 0 < f <= 1:
            hint = ""
            if 1 < f <= 100:
                hint = f' For {f:g} % write budget={f / 100!r} or budget="{f:g}%"; for a count, an int.'
            raise PlanError(f"select: budget={budget!r} is not a fraction in (0, 1]; {_BUDGET_RULE}.{hint}")
        return "fraction", f
    if isinstance(budget, str):
        m = _PERCENT.fullmatch(budget)
        if m is None or not 0 < Decimal(m.group(1)) <= 100:
            raise PlanError(f'select: budget={budget!r} is not a percent in (0, 100] such as "1%"; {_BUDGET_RULE}.')
        return "fraction", float(Decimal(m.group(1)) / 100)
    raise PlanError(f"select: budget={budget!r} ({type(budget).__name__}); {_BUDGET_RULE}.")


def count_of(budget: tuple[str, float | int], n: int, given: Any) -> int:
    """How many of ``n`` candidate elements the checked ``budget`` selects (``given``: as the caller wrote it).

    A fraction is rounded half up, at least 1. A count of 1 to
    :data:`LOOKS_LIKE_PERCENT` is kept, with a :class:`FreezeWarning` that
    says how many elements it selects and how to write a percent.

    Raises:
        PlanError: a count larger than ``n``.
    """
    kind, value = budget
    if kind == "fraction":
        return max(1, int(np.floor(value * n + 0.5)))
    if value > n:
        raise PlanError(f"select: budget={given!r} elements, but {n:,} elements can be chosen; use 1..{n}.")
    if value <= LOOKS_LIKE_PERCENT:
        warnings.warn(
            f"select: budget={given!r} is a count: it selects {value:,} of the {n:,} candidate elements "
            f"({100 * value / n:.3g} %). For {value} % of them write budget={value / 100!r} or "
            f'budget="{value}%".',
            FreezeWarning,
            stacklevel=3,
        )
    return value


def check_arguments(score, data, batch_size, batches, structure) -> tuple[int, int | None]:
    """``select``'s other arguments checked (:class:`PlanError`); ``batch_size`` and ``batches`` as Python ints."""
    if score not in SCORES:
        raise PlanError(f"select: unknown score {score!r}; choose one of {', '.join(SCORES)}.")
    if not _count(batch_size, 1):
        raise PlanError(f"select: batch_size must be an int >= 1; got {batch_size!r}.")
    if batches is not None and not _count(batches, 1):
        raise PlanError(f"select: batches must be None or an int >= 1; got {batches!r}.")
    if structure not in STRUCTURES:
        raise PlanError(f"select: structure={structure!r}; choose one of {', '.join(map(repr, STRUCTURES))}.")
    if score in DATA_SCORES:
        need_gradients(score)
    if score in DATA_SCORES and data is None:
        raise PlanError(
            f"select: score={score!r} needs data; pass data=(x, y), a tf.data.Dataset or an iterable of "
            "batches, or use score='magnitude' or 'random'."
        )
    return int(batch_size), None if batches is None else int(batches)
