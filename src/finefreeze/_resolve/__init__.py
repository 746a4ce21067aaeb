"""Room of resolution: a plan against the variables of a target, element by element.

Owns: collecting a target's variables (``targets``), names as scopes
(``scopes``), compact masks (``masks``), blocks of a model (``blocks``), the
immutable ``Resolution`` (``resolve``), the fingerprint of frozen elements
that ``verify`` checks (``fingerprint``) and the stand-ins of sliced
kernels' trained elements (``standins``).

May import: ``finefreeze._errors``, ``_backends``, ``_plan``.
"""
