"""Room of KerasHub tasks: new tokens for a task's tokenizer and its token embedding (``add_tokens``).

KerasHub is optional: its modules are imported when a function here runs,
with the install hint when it is missing.

May import: every room below it (``_data``'s row: ``_callbacks`` and those it uses).
"""
