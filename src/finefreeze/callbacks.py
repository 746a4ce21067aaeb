"""Keras callbacks: ``FreezeSchedule``, ``GradualUnfreezing``, ``Reselect`` and ``FreezeBoard`` (TensorBoard).

Example:
    >>> import finefreeze as ff
    >>> sorted(ff.callbacks.__all__)
    ['FreezeBoard', 'FreezeSchedule', 'GradualUnfreezing', 'Reselect']
"""

from finefreeze._callbacks.board import FreezeBoard as FreezeBoard
from finefreeze._callbacks.reselect import Reselect as Reselect
from finefreeze._callbacks.schedule import FreezeSchedule as FreezeSchedule
from finefreeze._callbacks.schedule import GradualUnfreezing as GradualUnfreezing

__all__ = ["FreezeBoard", "FreezeSchedule", "GradualUnfreezing", "Reselect"]
