"""The Freezer a callback works with: the one given, else the model's own (``Freezer.of``)."""

from __future__ import annotations

from finefreeze._freezer.freezer import Freezer

__all__ = ["freezer_of"]


def freezer_of(model, given, who: str):
    """``given``, else the Freezer of ``model`` (``Freezer.of``).

    Raises:
        TypeError: there is none; the message says how to fix it.
    """
    if given is not None:
        return given
    frz = Freezer.of(model)
    if frz is None:
        raise TypeError(
            f"{who} needs a Freezer: compile the model with optimizer=frz.wrap(...) or pass {who}(..., freezer=frz)."
        )
    return frz
