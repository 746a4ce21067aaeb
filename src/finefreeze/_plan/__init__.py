"""Room of plans: rules, selectors, index suffixes, plan files.

Owns what a user writes: ``Rule`` (``freeze``/``train``), the normalisation of
every selector form, numpy-style index suffixes, ``Plan`` and its files.
No Keras import at module level: a plan is built and saved without Keras.

May import: ``finefreeze._errors``, ``finefreeze._backends``.
"""
