"""Room of selection from data: ``select`` and the scores it ranks by.

May import: every room below ``_freezer`` and ``_freezer``.
"""
