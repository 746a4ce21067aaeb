"""``add_tokens``: new tokens for a KerasHub task's tokenizer and new rows for its token embedding.

The new task is built from the old one's configuration with a larger
``vocabulary_size``; every weight is copied over by path, the pretrained
rows of the token embedding (and of an untied output table) bit for bit.
Nothing of the task it is given changes, on success or on error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras
import ml_dtypes
import numpy as np

from finefreeze._errors import PlanError
from finefreeze._hub.tokenizers import grown, vocabulary_of

if TYPE_CHECKING:
    import keras_hub

__all__ = ["add_tokens"]

HUB_HINT = "pip install 'finefreeze[hub]' (KerasHub)"
INITS = ("mean", "zeros")


def add_tokens(
    task: keras_hub.models.Task, tokens: Sequence[str] | int, *, init: str | np.ndarray = "mean"
) -> keras_hub.models.Task:
    """A copy of a KerasHub task whose tokenizer knows ``tokens`` and whose token embedding has a row for each.

    The returned task is a new object of the same class (``GemmaCausalLM``,
    ``LlamaCausalLM``, ...), built from the task's configuration with
    ``vocabulary_size`` grown by ``len(tokens)``. Every weight is copied
    over; the pretrained rows ``[:old]`` of the token embedding (and, for an
    untied model, the columns ``[:, :old]`` of its ``reverse_embeddings``)
    are bit-identical to the task's. The new tokens get the ids ``old``,
    ``old + 1``, ... in the order given, and the tokenizer encodes each as
    one id (SentencePiece: a user-defined piece; byte-pair: an unsplittable
    token). Its preprocessor keeps its configuration (``sequence_length``
    ...). The new task is not compiled and has no Freezer; the given task
    is left as it was (both are in memory while the weights are copied).

    Args:
        task: a KerasHub task (``keras_hub.models.CausalLM`` and the like)
            whose backbone has a ``token_embedding``.
        tokens: the new tokens, a list of distinct strings not yet in the
            vocabulary. For a task without a preprocessor (token ids in, no
            tokenizer), an int: the number of rows to add.
        init: the new rows' values. ``"mean"``: the mean of the pretrained
            rows (computed in float64, cast to the table's dtype), so that
            the model's output is unchanged in expectation; ``"zeros"``; or
            an array of shape ``(len(tokens), hidden)`` (an untied output
            table gets its transpose).

    Returns:
        The new task.

    Raises:
        PlanError: a model that is not a KerasHub task with a token
            embedding, an empty list, a token that is not a non-empty
            string, a repeated token, a token already in the vocabulary
            (with its id), a tokenizer it cannot extend, or an ``init`` it
            cannot use.
        ImportError: KerasHub is not installed.

    Example:
        A task with a tokenizer takes the new tokens as strings, e.g.
        ``lm = ff.add_tokens(lm, ["<tool>", "</tool>"])``; one without
        takes the number of rows. Then a plan trains only the new rows:

        >>> import keras_hub, finefreeze as ff
        >>> backbone = keras_hub.models.GemmaBackbone(
        ...     vocabulary_size=8, num_layers=1, num_query_heads=1, num_key_value_heads=1,
        ...     hidden_dim=4, intermediate_dim=8, head_dim=4)
        >>> lm = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
        >>> old = lm.backbone.vocabulary_size
        >>> lm = ff.add_tokens(lm, 2)
        >>> lm.backbone.vocabulary_size
        10
        >>> plan = ff.Plan([ff.freeze("**"), ff.train(f"token_embedding/embeddings[{old}:]")])
    """
    hub = _keras_hub()
    backbone = _backbone_of(hub, task)
    old = _vocabulary_size(backbone)
    tables = _tables(backbone)
    tokenizer = getattr(task.preprocessor, "tokenizer", None)
    names = None if tokenizer is None else _token_list(tokens, vocabulary_of(hub, tokenizer))
    n = _count(task, tokens) if names is None else len(names)
    _check_init(init, n, int(tables[0][0].shape[1]))
    new_tokenizer = None if names is None else grown(hub, tokenizer, names, old)
    new = _rebuild(task, old + n, new_tokenizer)
    _copy(task, new, {v.path: axis for v, axis in tables}, n, init)
    return new


def _keras_hub():
    try:
        import keras_hub
    except ImportError as e:
        raise ImportError(f"add_tokens works on KerasHub tasks and needs KerasHub ({e}): {HUB_HINT}") from None
    return keras_hub


def _backbone_of(hub, task):
    if not isinstance(task, hub.models.Task):
        raise PlanError(
            f"add_tokens: received a {type(task).__name__}, not a KerasHub task; it takes a task such as "
            "keras_hub.models.GemmaCausalLM.from_preset(...), whose backbone's token_embedding and tokenizer it grows."
        )
    backbone = task.backbone
    layer = getattr(backbone, "token_embedding", None)
    if getattr(layer, "embeddings", None) is None:
        raise PlanError(
            f"add_tokens: the backbone {type(backbone).__name__} of {type(task).__name__} has no token_embedding "
            "table to grow; add_tokens takes a text task (a causal LM such as GemmaCausalLM)."
        )
    return backbone


def _vocabulary_size(backbone) -> int:
    size = backbone.get_config().get("vocabulary_size")
    rows = int(backbone.token_embedding.embeddings.shape[0])
    if size != rows:
        raise PlanError(
            f"add_tokens: the backbone {type(backbone).__name__}'s configuration says vocabulary_size={size!r} but "
            f"its token_embedding has {rows:,} rows; add_tokens rebuilds the backbone from that configuration."
        )
    return rows


def _tables(backbone) -> list[tuple[Any, int]]:
    """``[(variable, axis of the vocabulary)]``: the token table, and an untied output table."""
    layer = backbone.token_embedding
    tables = [(layer.embeddings, 0)]
    reverse = getattr(layer, "reverse_embeddings", None)
    if reverse is not None and not getattr(layer, "tie_weights", False):
        tables.append((reverse, 1))
    return tables


def _count(task, tokens) -> int:
    """The rows to add to a task without a tokenizer (``tokens`` must be a positive int)."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 1:
        raise PlanError(
            f"add_tokens: {type(task).__name__} has no preprocessor, so no tokenizer to add tokens to; received "
            f"tokens={tokens!r}. Pass the number of rows to add (an int >= 1), or a task with its preprocessor."
        )
    return int(tokens)


def _token_list(tokens, vocabulary: dict[str, int]) -> list[str]:
    """``tokens`` as a list, refused when empty, not strings, repeated or already in ``vocabulary``."""
    if isinstance(tokens, (int, np.integer)):
        raise PlanError(
            f"add_tokens: received tokens={tokens!r}, but the task has a tokenizer: pass the new tokens as strings, "
            "e.g. ['<tool>', '</tool>'] (a number of rows is for a task without a preprocessor)."
        )
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise PlanError(
            f"add_tokens: tokens must be a list of strings; received {tokens!r}. Write add_tokens(task, [{tokens!r}])."
        )
    names = list(tokens)
    if not names:
        raise PlanError("add_tokens: tokens is empty; pass the new tokens, e.g. ['<tool>', '</tool>'].")
    for i, token in enumerate(names):
        if not isinstance(token, str) or not token:
            raise PlanError(f"add_tokens: tokens[{i}] is {token!r}; every token must be a non-empty string.")
        if token in names[:i]:
            raise PlanError(
                f"add_tokens: {token!r} is in tokens twice (at {names.index(token)} and {i}); list it once."
            )
        if token in vocabulary:
            raise PlanError(
                f"add_tokens: {token!r} is already in the vocabulary, with id {vocabulary[token]:,}; leave it out of "
                "tokens (its row is trained by selecting it: token_embedding/embeddings[id])."
            )
    return names


def _check_init(init, n: int, hidden: int) -> None:
    if isinstance(init, str):
        if init not in INITS:
            raise PlanError(
                f"add_tokens: init={init!r} is not one of {INITS}; or pass an array of shape ({n}, {hidden})."
            )
        return
    shape = np.shape(init)
    if shape != (n, hidden):
        raise PlanError(
            f"add_tokens: init has shape {shape}, but the {n} new rows of the token embedding need ({n}, {hidden})."
        )


def _rebuild(task, size: int, tokenizer):
    """A task of ``task``'s class and configuration, ``size`` tokens, ``tokenizer`` in its preprocessor."""
    config = task.backbone.get_config()
    config["vocabulary_size"] = size
    backbone = type(task.backbone).from_config(config)
    preprocessor = task.preprocessor
    if preprocessor is not None:
        config = preprocessor.get_config()
        config["tokenizer"] = tokenizer
        preprocessor = type(preprocessor).from_config(config)
    config = task.get_config()
    config.update(backbone=backbone, preprocessor=preprocessor)
    return type(task).from_config(config)


def _by_path(model) -> dict[str, Any]:
    out = {}
    for v in model.weights:
        if v.path in out:
            raise PlanError(f"add_tokens: two weights of {model.name!r} share the path {v.path!r}; it copies by path.")
        out[v.path] = v
    return out


def _copy(task, new, grow: dict[str, int], n: int, init) -> None:
    """Every weight of ``task`` into ``new`` by path; the tables in ``grow`` get ``n`` new rows along their axis."""
    old_vars, new_vars = _by_path(task), _by_path(new)
    if old_vars.keys() != new_vars.keys():
        differ = sorted(old_vars.keys() ^ new_vars.keys())[:5]
        raise PlanError(f"add_tokens: the rebuilt {type(task).__name__} has other weights than the task ({differ}).")
    for path, v in new_vars.items():
        shape = list(old_vars[path].shape)
        if path in grow:
            shape[grow[path]] += n
        if tuple(shape) != tuple(v.shape):
            raise PlanError(
                f"add_tokens: {path} changes from {tuple(old_vars[path].shape)} to {tuple(v.shape)} with the "
                "vocabulary, and only the token embedding's tables can grow (a quantized embedding, or an output "
                "layer of its own, cannot)."
            )
    for path, v in new_vars.items():
        value = keras.ops.convert_to_numpy(old_vars[path].value)
        if path in grow:
            value = np.concatenate([value, _new_rows(value, grow[path], n, init, v.dtype)], axis=grow[path])
        v.assign(value)


def _new_rows(table: np.ndarray, axis: int, n: int, init, dtype: str) -> np.ndarray:
    """``n`` new rows (``axis`` 0) or columns (``axis`` 1) for ``table``, in the variable's ``dtype``."""
    if isinstance(init, str) and init == "mean":
        mean = np.mean(table, axis=axis, dtype=np.float64, keepdims=True)
        rows = np.repeat(mean, n, axis=axis)
    elif isinstance(init, str):
        rows = np.zeros((n, table.shape[1]) if axis == 0 else (table.shape[0], n), np.float64)
    else:
        rows = np.asarray(init) if axis == 0 else np.asarray(init).T
    # rounded once, to the variable's own dtype (bfloat16 too), then in the dtype its values came back in
    name = keras.backend.standardize_dtype(dtype)
    return rows.astype(np.dtype(getattr(ml_dtypes, name, name))).astype(table.dtype)
