"""Room of files: delta files and outputs that are never half-written.

Owns: writing and applying deltas (``delta``), their safetensors format
(``deltafile``), atomic outputs and interrupt handling (``atomic``).

May import: ``finefreeze._errors``, ``_backends``, ``_plan``, ``_resolve``,
``_enforce``, ``_optimizer``.
"""
