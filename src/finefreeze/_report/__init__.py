"""Room of reports: what a Freezer holds, shown to people and tools.

Owns: the JSON-able report and the summary table (``report``), the grouped
summary (``groups``), optimizer state sizes (``state_size``), pictures
(``plot``, ``maskview``) and TensorBoard event files (``events``).

May import: ``finefreeze._errors``, ``_backends``, ``_plan``, ``_resolve``,
``_enforce``, ``_optimizer``. A Freezer reaches it as an argument, never
through an import.
"""
