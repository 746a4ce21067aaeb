"""Room of Keras callbacks: ``FreezeSchedule``, ``GradualUnfreezing``, ``Reselect``, ``FreezeBoard``.

Public through ``finefreeze.callbacks``.

May import: every room below it (``_freezer``, ``_select`` and what they use).
"""
