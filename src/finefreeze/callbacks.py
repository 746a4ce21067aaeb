"""Keras callbacks: ``FreezeBoard`` (TensorBoard).

Example:
    >>> import finefreeze as ff
    >>> ff.callbacks.FreezeBoard.__name__
    'FreezeBoard'
"""

from finefreeze._board import FreezeBoard as FreezeBoard

__all__ = ["FreezeBoard"]
