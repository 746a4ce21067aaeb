"""Room of the command line: ``finefreeze finetune``, ``inspect``, ``verify``, ``delta``.

Owns: argument parsing and exit codes (``commands``), the main job
(``finetune``), checked inputs (``inputs``) and ``--select`` (``selectfile``).

May import: every room. ``import finefreeze`` stays light: Keras is imported
only once a command runs.
"""
