"""Room of the command line: ``finefreeze finetune``, ``inspect``, ``verify``, ``delta``.

Owns: the commands and exit codes (``commands``), their arguments (``parser``), ``delta export`` and
``delta apply`` (``deltas``), the checks
before a framework loads (``checks``), the main job
(``finetune``) and its batches (``epochs``), checked inputs (``inputs``), KerasHub preset folders and
text data (``presets``), ``--select`` (``selectfile``) and TensorFlow kept quiet (``quiet``).

May import: every room. ``import finefreeze`` stays light: Keras is imported
only once a command runs.

``main`` is re-exported: the console script names ``finefreeze._cli:main`` (as
release 0.1's did, so an install made then keeps working).
"""

from finefreeze._cli.commands import main as main

__all__ = ["main"]
