"""The vocabulary of finefreeze: what a plan decides for a variable, and how a layout keeps it.

Two ideas, two words, one table each:

- a variable's **state** (what the plan decided, :class:`State`):
  ``trainable``, ``frozen``, ``partial`` (some elements frozen) or
  ``untrained`` (Keras does not train it: BatchNorm moving statistics);
- a layout's **kind** (how the optimizer keeps it, :class:`Kind`): ``train``,
  ``frozen``, or one of the strategies for partially frozen variables,
  ``restore``, ``compact``, ``mask``.

The values are plain strings: they are what reports, summaries, saved
configs and ``Freezer.variable_state`` show.

Example:
    >>> from finefreeze._kinds import KINDS, Kind
    >>> Kind.COMPACT, KINDS[Kind.COMPACT].enforced
    ('compact', True)
"""

from __future__ import annotations

import dataclasses

__all__ = ["KINDS", "STATES", "STRATEGIES", "Kind", "KindInfo", "State"]


class State:
    """What a plan decided for one variable."""

    TRAINABLE = "trainable"
    FROZEN = "frozen"
    PARTIAL = "partial"
    UNTRAINED = "untrained"


STATES = (State.TRAINABLE, State.FROZEN, State.PARTIAL, State.UNTRAINED)


class Kind:
    """How a layout keeps one variable."""

    TRAIN = "train"
    FROZEN = "frozen"
    RESTORE = "restore"
    COMPACT = "compact"
    MASK = "mask"


@dataclasses.dataclass(frozen=True)
class KindInfo:
    """One row of the table of kinds."""

    enforced: bool  # elements frozen inside the variable, kept by an enforcer
    exact: bool  # frozen elements bit-identical with every optimizer
    state: str  # optimizer state the inner optimizer keeps for it
    means: str


#: the table of kinds
KINDS = {
    Kind.TRAIN: KindInfo(False, True, "dense", "trained whole (lr_scale aside)"),
    Kind.FROZEN: KindInfo(False, True, "none", "out of training: no gradient, no state"),
    Kind.RESTORE: KindInfo(True, True, "dense", "frozen gradients selected to 0, frozen elements written back"),
    Kind.COMPACT: KindInfo(True, True, "trainable elements", "the inner optimizer updates a flat vector of them"),
    Kind.MASK: KindInfo(True, False, "dense", "gradient masking alone (the folk recipe, for comparison)"),
}

#: what a user may ask for: ``auto`` picks ``compact`` or ``restore`` per variable
STRATEGIES = ("auto", Kind.RESTORE, Kind.COMPACT, Kind.MASK)
