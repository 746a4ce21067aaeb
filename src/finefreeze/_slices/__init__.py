"""Room of sliced gradients: a kernel's trained elements get their own gradient, handed to a stand-in.

Owns: which block, rows or scattered elements of a partially frozen kernel
get their own weight gradient and whether it pays (``choose``), the
product that computes it (``product``, ``sampled``: the backend's own
vector-Jacobian product through the chosen backend module's tap), and the
layers' own ``call`` that runs it (``calls``). The stand-ins themselves are
variables of the target (``finefreeze._resolve.standins``).

May import: ``_backends``, ``_keras``, ``_plan``, ``_resolve`` and the foundation.
"""
