"""Room of selection from data: ``select``, its arguments (``arguments``) and the scores it ranks by.

May import: ``_freezer`` and every room below it.
"""
