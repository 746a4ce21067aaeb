"""What each Keras backend measured: where a kernel's own weight gradient pays (``gradients="auto"``)."""

from __future__ import annotations

from finefreeze._backends.questions import keras_backend

__all__ = ["AUTO_PAYS", "AUTO_SAMPLES", "MEMORY_AT", "auto_pays", "auto_samples"]

#: ``gradients="auto"``, per backend: the largest fraction of a kernel a block of ranges and a block with
#: an index list (taken by a gather) get their own weight gradient at, and the fewest elements the kernel
#: needs for it (below, the slice's taps cost more than the product they save). Measured with
#: ``benchmarks/slices.py --only "cols 10 %,cols 10 % list,cols 25 %,cols 50 %,cols 50 % list,..."`` at
#: widths 64, 256 and 896 (docs/benchmarks.md, *Where slicing pays*); a tie counts as paying, for the state.
AUTO_PAYS = {
    "tensorflow": (0.25, 0.0, 1 << 16),
    "jax": (0.5, 0.1, 1 << 16),
    "torch": (0.5, 0.25, 1 << 16),
}

#: ``gradients="auto"``, per backend: the largest fraction of a ``Dense`` kernel (of at least the elements
#: :data:`AUTO_PAYS` names) whose scattered trained elements get the sampled product, about where it stops
#: paying. Measured with ``benchmarks/slices.py --only "elements 0.1 %,elements 0.1 % dense,elements 0.3 %,..."``
#: (docs/benchmarks.md, *Scattered elements*): it paid at 0.1 % on every backend, at 0.3 % on TensorFlow
#: and PyTorch (JAX: in one run of two), at 1 % on PyTorch and (barely) TensorFlow, and at 3 % on PyTorch
#: alone (its sparse ``sampled_addmm``).
AUTO_SAMPLES = {
    "tensorflow": 0.005,
    "jax": 0.001,
    "torch": 0.03,
}


#: ``gradients="auto"``: a partially frozen kernel of at least this many elements gets its slice's or its
#: elements' own gradient whatever the step time measured above says: its dense gradient (4 MiB of float32 and
#: up, per kernel and per step) and its optimizer state are memory that matters at the model's size. On the
#: 152 M Gemma-shaped model of ``benchmarks/llm_memory.py`` that is every projection but key and value
#: (one key/value head: 131,072 elements); on the small models of ``benchmarks/slices.py``, nothing.
MEMORY_AT = 1 << 20


def auto_pays(backend: str | None = None) -> tuple[float, float, int] | None:
    """:data:`AUTO_PAYS` of ``backend`` (default: the Keras backend in force); None where never measured."""
    return AUTO_PAYS.get(backend or keras_backend())


def auto_samples(backend: str | None = None) -> float | None:
    """:data:`AUTO_SAMPLES` of ``backend`` (default: the Keras backend in force); None where never measured."""
    return AUTO_SAMPLES.get(backend or keras_backend())
