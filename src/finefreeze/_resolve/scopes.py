"""Names are scopes: a nested layer's name is a path scope, even where Keras leaves it out.

Keras names a variable by the name scopes open when it was created. A model
built on its own and then called inside another one (the transfer-learning
pattern ``outputs = head(base(inputs))``) creates its variables outside the
outer model, so their paths lack the nested model's name: ``Conv1/kernel``,
not ``mobilenetv2_1.00_224/Conv1/kernel``. Each such variable gets an alias
with the names of the enclosing layers its path leaves out, so
``freeze("mobilenetv2_1.00_224/**")`` selects the backbone. The real Keras
path stays the variable's path (reports, layouts, delta files use it); the
alias is one more name selectors match.

An alias that would name two variables (or equal another variable's real
path) is dropped and remembered, so a rule that selects nothing can say why.
"""

from __future__ import annotations

from finefreeze._keras.layers import sublayers

__all__ = ["scoped_aliases", "drop_ambiguous_aliases", "ambiguity_note", "layer_scope"]


def scoped_aliases(path: str, scope: tuple[str, ...]) -> tuple[str, ...]:
    """The scoped alias of a variable path, given the names of its enclosing layers.

    Args:
        path: the variable's Keras path.
        scope: names of the layers from the target (exclusive) down to the
            variable's owner (inclusive).

    Returns:
        ``()`` when the path already holds every enclosing name, else a
        one-element tuple with the missing names put in front.

    Example:
        >>> scoped_aliases("Conv1/kernel", ("mobilenetv2", "Conv1"))
        ('mobilenetv2/Conv1/kernel',)
        >>> scoped_aliases("seq/dense/kernel", ("seq", "dense"))
        ()
    """
    segments = set(path.split("/")[:-1])
    missing = [n for n in scope if n not in segments]
    if not missing:
        return ()
    return ("/".join([*missing, path]),)


def drop_ambiguous_aliases(infos) -> dict[str, list[str]]:
    """Remove aliases that name several variables or another variable's path.

    Args:
        infos: the target's ``VarInfo`` records; their ``names`` are rewritten.

    Returns:
        ``{alias: [paths it would name]}`` for every alias dropped.
    """
    owners: dict[str, list[str]] = {}
    for vi in infos:
        for n in vi.names[1:]:
            owners.setdefault(n, []).append(vi.path)
    real = {vi.path for vi in infos}
    bad = {n: ps for n, ps in owners.items() if len(ps) > 1 or n in real}
    if bad:
        for vi in infos:
            if any(n in bad for n in vi.names[1:]):
                vi.names = (vi.path, *(n for n in vi.names[1:] if n not in bad))
        for n in bad:
            if n in real:
                bad[n] = sorted({*bad[n], n})
    return bad


def ambiguity_note(regex, ambiguous: dict[str, list[str]]) -> str:
    """A sentence naming the dropped aliases a rule's pattern would have matched ('' if none)."""
    hits = [n for n in ambiguous if regex.fullmatch(n)]
    if not hits:
        return ""
    n = hits[0]
    return (
        f" The scoped name {n!r} is ambiguous (it names {', '.join(ambiguous[n])}), so selectors do not "
        "use it; select by the variables' own paths (scoped names where twins share one) or pass the layer instance."
    )


def layer_scope(target, layer) -> str | None:
    """The scoped path of a layer inside a Keras target (``base/Conv1``), or None if absent."""

    def walk(node, prefix):
        for sub in sublayers(node):
            path = (*prefix, sub.name)
            if sub is layer:
                return "/".join(path)
            got = walk(sub, path)
            if got:
                return got
        return None

    return walk(target, ())
