"""A quantized base on the command line: ``finetune --quantize``, and the base a quantized run's files need.

``finetune --quantize int8`` (or ``int4``) quantizes the model with Keras
before the plan applies, every layer Keras can quantize but those whose
kernel the plan trains in full (a new head stays float) and those inside a
Keras ``MultiHeadAttention`` (Keras 3.15 saves them quantized but cannot load
them back: ``load_model`` raises "expected 2 variables, but received 0").
The plan's kernels then train as float deltas beside the integers, QLoRA's
base. A delta file of such a run records which kernels were quantized and
how; ``generate``, ``verify`` and ``delta apply`` quantize a float base the
same way before they use it (quantizing the same float weights the same way
gives the same integers, which the delta's digests check).
"""

from __future__ import annotations

import warnings

from finefreeze._files.atomic import UserError

__all__ = [
    "quantize_base",
    "quantize_as",
    "quantized_kernels",
    "delta_quantization",
    "refuse_trained_deltas",
    "refuse_without_delta",
]


def _quantizable(layer):
    """The variable Keras quantizes in ``layer`` (a kernel or a table), or None."""
    from finefreeze._keras.layers import embeddings_variable, kernel_variable

    v = kernel_variable(layer)
    return v if v is not None else embeddings_variable(layer)


def _quantized_with(layer) -> list:
    """Every variable Keras quantizes with ``layer``: its kernel or table, and an untied output table."""
    v = _quantizable(layer)
    if v is None:
        return []
    reverse = None if getattr(layer, "tie_weights", True) else getattr(layer, "reverse_embeddings", None)
    return [v] if reverse is None else [v, reverse]


def _quantize(model, mode: str, keep) -> None:
    """``model.quantize(mode)`` on the layers ``keep(layer)`` accepts; Keras' notes on layers it skips, quiet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have a `quantize` method")
        try:
            model.quantize(mode, filters=keep)
        except (ValueError, NotImplementedError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"Keras cannot quantize this model to {mode}: {first}") from None


def _in_multi_head_attention(model) -> set[int]:
    """The ids of the layers inside a Keras ``MultiHeadAttention`` (KerasHub's cached one included)."""
    import keras

    from finefreeze._keras.layers import all_layers

    attention = [x for x in all_layers(model, include_self=False) if isinstance(x, keras.layers.MultiHeadAttention)]
    return {id(x) for a in attention for x in all_layers(a, include_self=False)}


def quantize_base(model, plan, mode: str) -> tuple[int, str]:
    """Quantize ``model`` to ``mode`` but the layers whose kernel ``plan`` trains in full.

    The layers of a Keras ``MultiHeadAttention`` stay float: a ``.keras``
    file of them quantized does not load back (Keras 3.15).

    Returns:
        ``(quantized, left float)``: the number of layers quantized, and a
        note on those left float (the plan trains their kernel in full, or
        they are inside a ``MultiHeadAttention``), "" when none is.

    Raises:
        UserError: nothing in the model can be quantized (``mode`` was
            checked by ``check_finetune``).
    """
    from finefreeze._resolve.resolve import TRAINABLE, resolve
    from finefreeze._resolve.targets import collect

    res = resolve(plan, collect(model))
    whole = {id(s.variable) for s in res.states if res.kind_of(s) == TRAINABLE}
    attention = _in_multi_head_attention(model)
    left = {"trained in full": 0, "inside MultiHeadAttention, which Keras cannot load back quantized": 0}

    def keep(layer) -> bool:
        kernel = _quantizable(layer)
        if kernel is None:
            return False
        if id(kernel) in whole:
            left["trained in full"] += 1
            return False
        if id(layer) in attention:
            left["inside MultiHeadAttention, which Keras cannot load back quantized"] += 1
            return False
        return True

    _quantize(model, mode, keep)
    from finefreeze._keras.layers import all_layers
    from finefreeze._keras.quantized import is_quantized

    done = sum(
        1 for layer in all_layers(model, include_self=False) if is_quantized(layer) and _quantizable(layer) is not None
    )
    if not done:
        raise UserError(
            f"--quantize {mode}: no layer of the model was quantized (Keras quantizes Dense, EinsumDense and "
            "Embedding layers; the plan trains those in full, or they are inside a MultiHeadAttention, which "
            "Keras cannot load back quantized); drop --quantize"
        )
    note = "; ".join(f"{n} {why}" for why, n in left.items() if n)
    return done, f"; left float: {note}" if note else ""


def quantized_kernels(model) -> dict[str, str]:
    """``{kernel path: mode}`` of every quantized layer of ``model`` (an untied output table's too)."""
    from finefreeze._keras.layers import all_layers
    from finefreeze._keras.quantized import is_quantized

    out = {}
    for layer in all_layers(model, include_self=False):
        mode = is_quantized(layer)
        for kernel in _quantized_with(layer) if mode is not None else []:
            out[kernel.path] = mode
    return out


def quantize_as(model, kernels: dict[str, str], source: str) -> None:
    """Quantize the layers of ``model`` whose kernels ``kernels`` names, each to its mode (float ones only).

    Raises:
        UserError: a named kernel is not in ``model`` (``source`` says whose it was).
    """
    if not kernels:
        return
    have = quantized_kernels(model)
    if all(have.get(p) == m for p, m in kernels.items()):
        return  # quantized as it should be already (a quantized run's tuned.keras)
    from finefreeze._keras.layers import all_layers

    by_path = {}
    for layer in all_layers(model, include_self=False):
        for kernel in _quantized_with(layer):
            by_path[kernel.path] = layer
    missing = sorted(p for p in kernels if p not in by_path)
    if missing:
        raise UserError(
            f"{source} was trained on a base whose {missing[0]!r} was quantized, and this base has no such kernel; "
            "give the base that run started from"
        )
    for mode in sorted(set(kernels.values())):
        chosen = {id(by_path[p]) for p, m in kernels.items() if m == mode and have.get(p) is None}
        if chosen:
            _quantize(model, mode, lambda layer, chosen=chosen: id(layer) in chosen)


def delta_quantization(path: str) -> dict[str, str]:
    """``{kernel path: mode}`` of the kernels a delta file was trained on quantized ({} for a float base)."""
    from finefreeze._errors import DeltaError
    from finefreeze._files.entries import read_entries

    try:
        entries = read_entries(path)
    except DeltaError as e:
        raise UserError(str(e)) from None
    return {p: e.quantized for p, e in entries.items() if e.quantized is not None}


def refuse_without_delta(model, path: str) -> None:
    """Raise :class:`UserError` when ``model`` (a quantized run's ``.keras`` at ``path``) trained float deltas.

    Its file holds the quantized base and the float weights that trained,
    not the deltas beside the integers: text from it alone would be the
    base's.
    """
    from finefreeze._cli.inputs import plan_from_keras_file
    from finefreeze._resolve.resolve import resolve
    from finefreeze._resolve.targets import collect

    kernels = quantized_kernels(model)
    plan = plan_from_keras_file(path) if kernels else None
    if plan is None:
        return
    try:
        res = resolve(plan, collect(model))
    except Exception:  # a plan that no longer resolves: nothing to say about deltas
        return
    refuse_trained_deltas(res, path, "pass the run's delta file, --delta delta.safetensors (from the same run folder)")


def refuse_trained_deltas(res, path: str, fix: str) -> None:
    """Raise :class:`UserError` when ``res`` trains a part of a quantized kernel of the ``.keras`` file at ``path``.

    What trained of it is a float delta beside its integers, which a
    ``.keras`` file does not hold; ``fix`` ends the message.
    """
    from finefreeze._resolve.resolve import PARTIAL

    trained = [s.path for s in res.states if s.info.quantized is not None and res.kind_of(s) == PARTIAL]
    if trained:
        raise UserError(
            f"{path!r} holds a quantized base whose kernels trained float deltas ({trained[0]!r} and "
            f"{len(trained) - 1} more), which a .keras file does not hold: {fix}"
        )
