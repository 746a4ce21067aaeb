"""New tokens for a KerasHub tokenizer: user-defined pieces of a SentencePiece model, or byte-pair vocabulary entries.

Each function returns a new tokenizer of the same class and configuration;
the tokenizer it is given is left as it was. A new token gets the ids
``first``, ``first + 1``, ... in the order given and is encoded as one id.
"""

from __future__ import annotations

from finefreeze._errors import PlanError

__all__ = ["vocabulary_of", "grown"]

#: the two tokenizer families KerasHub's causal LMs use
_SUPPORTED = (
    "keras_hub.tokenizers.SentencePieceTokenizer (Gemma, Llama, Mistral, ...) or BytePairTokenizer (GPT-2, ...)"
)


def _kind(hub, tokenizer) -> str:
    if isinstance(tokenizer, hub.tokenizers.SentencePieceTokenizer):
        return "sentencepiece"
    if isinstance(tokenizer, hub.tokenizers.BytePairTokenizer):
        return "bytepair"
    raise PlanError(
        f"add_tokens: the task's tokenizer is a {type(tokenizer).__name__}, which add_tokens cannot extend; it extends "
        f"{_SUPPORTED}. Add the tokens to that tokenizer yourself, then grow the embedding with an int: "
        "add_tokens(task_without_preprocessor, n)."
    )


def vocabulary_of(hub, tokenizer) -> dict[str, int]:
    """``{token: id}`` of ``tokenizer``'s vocabulary (raises :class:`PlanError` for a tokenizer it cannot extend)."""
    if _kind(hub, tokenizer) == "sentencepiece":
        return {piece: i for i, piece in enumerate(tokenizer.get_vocabulary())}
    return dict(tokenizer.vocabulary)


def grown(hub, tokenizer, tokens: list[str], first: int):
    """A tokenizer like ``tokenizer`` that also encodes each of ``tokens`` as one id, ``first`` onwards."""
    if _kind(hub, tokenizer) == "sentencepiece":
        return _sentencepiece(tokenizer, tokens, first)
    return _bytepair(tokenizer, tokens, first)


def _sentencepiece(tokenizer, tokens: list[str], first: int):
    """Append ``tokens`` to the model proto as USER_DEFINED pieces (ids are positions: they must start at ``first``)."""
    try:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as model_pb2
    except ImportError as e:
        raise ImportError(
            f"add_tokens edits a SentencePiece model with the sentencepiece package ({e}): "
            "pip install sentencepiece protobuf"
        ) from None
    size = tokenizer.vocabulary_size()
    if size != first:
        raise PlanError(
            f"add_tokens: the tokenizer {type(tokenizer).__name__} has {size:,} pieces but the token embedding has "
            f"{first:,} rows; a SentencePiece piece's id is its position, so new pieces would not get the new rows' "
            "ids. Use a task whose tokenizer and embedding have the same vocabulary size."
        )
    model = model_pb2.ModelProto()
    model.ParseFromString(tokenizer.proto)
    for token in tokens:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = token, 0.0, model_pb2.ModelProto.SentencePiece.USER_DEFINED
    proto = model.SerializeToString()
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto)
    for token in tokens:
        pieces = processor.EncodeAsPieces(token)
        if pieces.count(token) != 1 or any(p not in (token, "\u2581") for p in pieces):
            raise PlanError(
                f"add_tokens: the SentencePiece model would encode {token!r} as {pieces}, not as one piece (it reads "
                "spaces as '\u2581' and normalizes the text first); use a token without spaces, as written after "
                "normalization."
            )
    config = tokenizer.get_config()
    config["proto"] = proto
    return type(tokenizer).from_config(config)


def _bytepair(tokenizer, tokens: list[str], first: int):
    """Add ``tokens`` to the vocabulary at ``first`` onwards and keep them whole (``unsplittable_tokens``)."""
    vocabulary = dict(tokenizer.vocabulary)
    top = max(vocabulary.values(), default=-1)
    if top >= first:
        raise PlanError(
            f"add_tokens: the tokenizer {type(tokenizer).__name__} has id {top:,} but the token embedding has {first:,} "
            "rows; use a task whose tokenizer's ids all have a row."
        )
    vocabulary.update({token: first + i for i, token in enumerate(tokens)})
    config = tokenizer.get_config()
    config.update(
        vocabulary=vocabulary,
        merges=list(tokenizer.merges),
        unsplittable_tokens=list(config.get("unsplittable_tokens") or []) + list(tokens),
    )
    return type(tokenizer).from_config(config)
