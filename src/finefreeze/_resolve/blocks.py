"""Blocks: the repeated stages of a model, found from its layer names.

Real architectures name the layers of a repeated block with a numbered
prefix: ``conv4_block1_1_conv`` (ResNet, DenseNet), ``block_3_expand``
(MobileNetV2), ``block2a_dwconv`` (EfficientNet), ``transformer_layer_0``
(KerasHub backbones, one layer holding a block). :func:`blocks` finds them:
among the numbered name prefixes it keeps the level with the most distinct
blocks whose blocks hold at least :data:`MIN_LAYERS` layers on average
(so ``conv4_block1`` wins over ``conv4`` and over ``conv4_block1_1``). A
block is a selector, and so is a slice of blocks: ``ff.train(blocks[-2:])``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from finefreeze._errors import PlanError
from finefreeze._keras.layers import sublayers

__all__ = ["Block", "Blocks", "blocks", "MIN_LAYERS"]

#: A level of numbered prefixes counts as blocks when its blocks hold at
#: least this many layers (sublayers included) on average.
MIN_LAYERS = 4

_INDEX = re.compile(r"\d+[a-z]?$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a model: the layers whose names start with ``name``.

    ``stage`` is the name without its last index (``conv4`` for
    ``conv4_block1``, ``block2`` for ``block2b``); ``selector`` is the path
    glob (or ``re:`` expression) that selects the block's variables, nested
    models included, and what a rule stores when given a block.

    Example:
        >>> import finefreeze as ff
        >>> from finefreeze._resolve.blocks import Block
        >>> b = Block("conv4_block1", "conv4", ("conv4_block1_1_conv",), 4160, "**/conv4_block1_*/**")
        >>> ff.train(b)
        train('**/conv4_block1_*/**')
    """

    name: str
    stage: str
    layers: tuple[str, ...]
    elements: int
    selector: str

    def __finefreeze_selector__(self) -> str:
        return self.selector

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {len(self.layers)} layers, {self.elements:,} elements)"


class Blocks(tuple):
    """The blocks of a model, first to last; a slice is a ``Blocks`` and a selector.

    Example:
        >>> from finefreeze._resolve.blocks import Block, Blocks
        >>> bs = Blocks([Block(f"layer_{i}", "layer", (f"layer_{i}",), 8, f"**/layer_{i}/**") for i in range(3)])
        >>> bs[-2:], bs[-2:].selector
        (Blocks(layer_1, layer_2), 're:(?:.*/)?(?:layer_1|layer_2)/.*')
    """

    def __getitem__(self, item):
        got = super().__getitem__(item)
        return Blocks(got) if isinstance(item, slice) else got

    @property
    def selector(self) -> str:
        """One ``re:`` selector for all these blocks."""
        if not self:
            raise PlanError("an empty list of blocks selects nothing; check the slice (ff.blocks(model)[-2:]).")
        frags = [_fragment(b) for b in self]
        if all(f.endswith("_[^/]*") for f in frags):
            names = "|".join(f[: -len("_[^/]*")] for f in frags)
            return f"re:(?:.*/)?(?:{names})_[^/]*/.*"
        return f"re:(?:.*/)?(?:{'|'.join(frags)})/.*"

    def __finefreeze_selector__(self) -> str:
        return self.selector

    def __repr__(self) -> str:
        if len(self) > 6:
            names = [b.name for b in self[:3]] + ["…"] + [b.name for b in self[-2:]]
        else:
            names = [b.name for b in self]
        return f"Blocks({', '.join(names)})"


def _fragment(b: Block) -> str:
    key = re.escape(b.name)
    exact = b.name in b.layers
    prefixed = any(n != b.name for n in b.layers)
    if exact and prefixed:
        return f"{key}(?:_[^/]*)?"
    return key if exact else f"{key}_[^/]*"


def _selector(name: str, layers: tuple[str, ...]) -> str:
    exact = name in layers
    prefixed = any(n != name for n in layers)
    if exact and prefixed:
        return f"re:(?:.*/)?{re.escape(name)}(?:_[^/]*)?/.*"
    return f"**/{name}/**" if exact else f"**/{name}_*/**"


def stage_of(name: str) -> str:
    """The stage of a block name: the name without its last index.

    Example:
        >>> stage_of("conv4_block1"), stage_of("block2b"), stage_of("transformer_layer_0")
        ('conv4', 'block2', 'transformer_layer')
    """
    tokens = name.split("_")
    last = tokens[-1]
    if re.search(r"\d[a-z]$", last):
        return "_".join([*tokens[:-1], last[:-1]])
    if len(tokens) > 1:
        return "_".join(tokens[:-1])
    return _INDEX.sub("", last)


def layers_under(layer) -> list:
    """Layers under ``layer`` (not itself), outer before inner, each once."""
    out, seen = [], set()

    def walk(node):
        for sub in sublayers(node):
            if id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
                walk(sub)

    walk(layer)
    return out


def _size(layer) -> int:
    n = 0
    for v in layer.weights:
        k = 1
        for d in v.shape:
            k *= int(d)
        n += k
    return n


def blocks(model: Any) -> Blocks:
    """Find the repeated blocks of a Keras model from its layer names.

    Nested models are searched too (a backbone inside a fine-tuning model).

    Args:
        model: a Keras model or layer.

    Returns:
        The blocks in model order (empty when the model has no repeated,
        numbered structure).

    Raises:
        PlanError: ``model`` is not a Keras layer.

    Example:
        >>> import keras, finefreeze as ff
        >>> x = inp = keras.Input((4,))
        >>> for b in range(3):
        ...     for part in ("a", "b", "c", "d"):
        ...         x = keras.layers.Dense(4, name=f"block{b}_{part}")(x)
        >>> model = keras.Model(inp, keras.layers.Dense(1, name="head")(x))
        >>> found = ff.blocks(model)
        >>> [b.name for b in found], found[-1].selector
        (['block0', 'block1', 'block2'], '**/block2_*/**')
        >>> ff.Plan([ff.freeze("**"), ff.train(found[-2:]), ff.train("head/**")])
        Plan([freeze('**'), train('re:(?:.*/)?(?:block1|block2)_[^/]*/.*'), train('head/**')])
    """
    import keras

    if not isinstance(model, keras.layers.Layer):
        raise PlanError(f"ff.blocks needs a Keras model or layer, got {type(model).__name__}.")
    layers = layers_under(model)
    counts = {id(x): 1 + len(layers_under(x)) for x in layers}
    levels: dict[str, dict[str, list]] = {}
    for layer in layers:
        tokens = layer.name.split("_")
        for k in range(1, len(tokens) + 1):
            if not re.search(r"\d", tokens[k - 1]):
                continue
            key = "_".join(tokens[:k])
            template = "_".join(_INDEX.sub("#", t) if re.search(r"\d", t) else t for t in tokens[:k])
            levels.setdefault(template, {}).setdefault(key, []).append(layer)
    best, best_score = None, (0, 0)
    for template, keys in levels.items():
        if len(keys) < 2:
            continue
        mean = sum(sum(counts[id(x)] for x in ls) for ls in keys.values()) / len(keys)
        score = (len(keys), -template.count("_"))
        if mean >= MIN_LAYERS and score > best_score:
            best, best_score = template, score
    if best is None:
        return Blocks(())
    out = []
    for key, members in levels[best].items():
        names = tuple(x.name for x in members)
        elements = sum(_size(x) for x in members if not any(x in layers_under(y) for y in members if y is not x))
        out.append(Block(key, stage_of(key), names, elements, _selector(key, names)))
    return Blocks(out)
