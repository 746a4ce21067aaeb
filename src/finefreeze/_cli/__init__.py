"""Room of the command line: ``finefreeze finetune``, ``inspect``, ``verify``, ``delta``, ``generate``.

Owns: the console script, which catches signals from its first step (``entry``), the commands and exit
codes (``commands``), their arguments (``parser``), ``delta export`` and
``delta apply`` (``deltas``), the checks
before a framework loads (``checks``), the main job
(``finetune``) and its batches (``epochs``), checked inputs (``inputs``), KerasHub preset folders and
text data (``presets``), causal LMs' corpora, default plan, perplexity and greedy text (``causal``),
``generate`` (``generate``), ``--select`` (``selectfile``) and TensorFlow kept quiet (``quiet``).

May import: every room. ``import finefreeze`` stays light: Keras is imported
only once a command runs.
"""
