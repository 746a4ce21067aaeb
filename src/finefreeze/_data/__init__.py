"""Room of bundled models and data: the example text model and the digits experiment.

Package data (``*.npz``) lives beside the modules.

May import: every room below it (``_callbacks`` and those it uses).
"""
