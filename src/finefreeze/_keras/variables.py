"""What finefreeze reads from a Keras variable beyond its public attributes."""

from __future__ import annotations

__all__ = ["distribution_layout"]


def distribution_layout(variable):
    """How ``keras.distribution`` shards ``variable`` (its ``_layout``), or None.

    Relies on: a variable made under a ``Distribution`` keeps its
    ``TensorLayout`` in ``_layout``; ``add_variable(..., layout=...)`` takes it
    so state made for the variable is sharded the same way.
    """
    return getattr(variable, "_layout", None)
