"""Turn every selector form into a small immutable predicate object.

Strings are globs on the whole path (``*`` one segment, ``**`` any number,
``?`` one character) or regular expressions after ``re:``; layer classes,
layer (or ``tf.Module``) instances, variables and ``(path, variable) -> bool``
callables are accepted too. All forms go through :func:`to_selector`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from collections.abc import Callable
from typing import Any

from finefreeze._backends.questions import is_module, is_variable
from finefreeze._errors import PlanError
from finefreeze._plan.index import split_suffix

__all__ = ["Selector", "to_selector", "glob_to_regex", "match_all"]


class Selector:
    """Base of the selector predicates; ``matches(var, ctx)`` decides."""

    def matches(self, var, ctx) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_json(self) -> Any:
        raise PlanError(
            f"selector {self!r} cannot be written to a plan file; use a path "
            "string (glob or 're:'), or {'layer_class': 'Name'}."
        )


def glob_to_regex(glob: str) -> str:
    """Translate a path glob to a full-match regular expression.

    ``**`` follows gitignore: leading ``**/`` and middle ``/**/`` match zero or
    more segments, a trailing ``/**`` one or more, ``**`` alone everything.

    Example:
        >>> import re
        >>> bool(re.fullmatch(glob_to_regex("**/dense/kernel"), "dense/kernel"))
        True
    """
    if glob == "**":
        return ".*"
    out, i, n = [], 0, len(glob)
    while i < n:
        if glob.startswith("**/", i) and (i == 0 or glob[i - 1] == "/"):
            out.append("(?:[^/]+/)*")
            i += 3
        elif glob.startswith("**", i) and i + 2 == n and i > 0 and glob[i - 1] == "/":
            out.append("[^/]+(?:/[^/]+)*")
            i += 2
        elif glob[i] == "*":
            while i < n and glob[i] == "*":
                i += 1
            out.append("[^/]*")
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class Glob(Selector):
    pattern: str
    regex: re.Pattern = dataclasses.field(compare=False, repr=False)

    def matches(self, var, ctx) -> bool:
        rx = self.regex
        return any(rx.fullmatch(p) for p in var.names)

    def to_json(self):
        return self.pattern

    def __repr__(self):
        return repr(self.pattern)


@dataclasses.dataclass(frozen=True)
class Regex(Selector):
    pattern: str
    regex: re.Pattern = dataclasses.field(compare=False, repr=False)

    def matches(self, var, ctx) -> bool:
        return any(self.regex.fullmatch(p) for p in var.names)

    def to_json(self):
        return "re:" + self.pattern

    def __repr__(self):
        return repr("re:" + self.pattern)


@dataclasses.dataclass(frozen=True)
class LayerClass(Selector):
    """Every layer (or module) of a type, given as a class or a class name."""

    cls: Any

    def matches(self, var, ctx) -> bool:
        return id(var.variable) in ctx.class_weight_ids(self.cls)

    def to_json(self):
        name = self.cls if isinstance(self.cls, str) else self.cls.__name__
        return {"layer_class": name}

    def __repr__(self):
        return self.cls if isinstance(self.cls, str) else self.cls.__name__


@dataclasses.dataclass(frozen=True, eq=False)
class Instance(Selector):
    """One layer or ``tf.Module``: all of its weights, sublayers included."""

    obj: Any

    def matches(self, var, ctx) -> bool:
        return id(var.variable) in ctx.instance_weight_ids(self.obj)

    def __repr__(self):
        return f"<{type(self.obj).__name__} {getattr(self.obj, 'name', '?')!r}>"


@dataclasses.dataclass(frozen=True, eq=False)
class VariableSel(Selector):
    variable: Any

    def matches(self, var, ctx) -> bool:
        return var.variable is self.variable or var.raw is self.variable

    def __repr__(self):
        return f"<variable {_var_path(self.variable)!r}>"


@dataclasses.dataclass(frozen=True, eq=False)
class CallableSel(Selector):
    fn: Callable

    def matches(self, var, ctx) -> bool:
        try:
            return bool(self.fn(var.path, var.variable))
        except Exception as e:  # a user callable failing is a plan problem
            raise PlanError(
                f"selector callable {self!r} raised {type(e).__name__}: {e} "
                f"on path {var.path!r} with shape {var.shape}; it must take "
                "(path, variable) and return a bool."
            ) from None

    def __repr__(self):
        return getattr(self.fn, "__name__", "callable")


def match_all(selector: Selector, target) -> frozenset[int] | None:
    """Indices of ``target.variables`` a selector matches, found in one pass, or None.

    A glob is matched once against all names joined by newlines (its regex
    never crosses a newline: ``[^/]`` becomes ``[^/\\n]``), so a plan of a
    few rules over 10,000 variables costs a few regex scans, not 10,000
    calls per rule. Layer classes and instances use their weight sets.
    Other selectors return None and are asked variable by variable.
    """
    if isinstance(selector, (Glob, Regex)):
        index = target.name_index
        if index is None:
            names = [(n, i) for i, vi in enumerate(target.variables) for n in vi.names]
            offsets = list(itertools.accumulate((len(n) + 1 for n, _ in names), initial=0))[:-1]
            text = "\n".join(n for n, _ in names)
            index = (names, offsets, text, any("\n" in n for n, _ in names))
            target.name_index = index
        names, offsets, text, has_newline = index
        if isinstance(selector, Regex) or has_newline:
            full = selector.regex.fullmatch
            return frozenset(i for n, i in names if full(n))
        rx = re.compile("^(?:" + selector.regex.pattern.replace("[^/]", "[^/\n]") + ")$", re.M)
        return frozenset(names[bisect.bisect_right(offsets, m.start()) - 1][1] for m in rx.finditer(text))
    if isinstance(selector, (LayerClass, Instance)):
        ids = target.class_weight_ids(selector.cls) if isinstance(selector, LayerClass) else None
        if ids is None:
            ids = target.instance_weight_ids(selector.obj)
        return frozenset(i for i, vi in enumerate(target.variables) if id(vi.variable) in ids)
    return None


def _var_path(v) -> str:
    p = getattr(v, "path", None)
    if p:
        return p
    return getattr(v, "name", "?").split(":")[0]


def to_selector(selector) -> tuple[Selector, str | None]:
    """Normalise a user selector; return the predicate and any index suffix.

    Raises:
        PlanError: an empty or malformed glob, a bad regex, an unknown type.
    """
    if selector is None:
        return Glob("**", re.compile(".*")), None
    as_selector = getattr(selector, "__finefreeze_selector__", None)
    if as_selector is not None and not isinstance(selector, type):  # ff.blocks(...) and slices of it
        selector = as_selector()
    if isinstance(selector, str):
        return _from_string(selector)
    if isinstance(selector, dict) and set(selector) == {"layer_class"}:
        name = selector["layer_class"]
        if not isinstance(name, str) or not name:
            raise PlanError(f"selector {selector!r}: 'layer_class' must be a class name string.")
        return LayerClass(name), None
    if isinstance(selector, type):
        return LayerClass(selector), None
    if is_variable(selector):
        return VariableSel(selector), None
    if is_module(selector):
        return Instance(selector), None
    if callable(selector):
        return CallableSel(selector), None
    raise PlanError(
        f"unknown selector type {type(selector).__name__}: {selector!r}. A "
        "selector is a path glob string, 're:<regex>', a layer class, a layer "
        "or tf.Module instance, a variable, or a callable (path, variable) -> bool."
    )


def _from_string(s: str) -> tuple[Selector, str | None]:
    if s.startswith("re:"):
        pattern = s[3:]
        if not pattern:
            raise PlanError(f"selector {s!r}: empty regular expression after 're:'.")
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise PlanError(
                f"bad regular expression in selector {s!r} at position "
                f"{(e.pos or 0) + 4}: {e.msg}. 're:' selectors take no index "
                "suffix; pick elements with mask=, indices= or where=."
            ) from None
        return Regex(pattern, rx), None

    path, suffix = split_suffix(s)
    problem = None
    if not path.strip():
        problem = "the path part is empty"
    elif path != path.strip():
        problem = "leading or trailing whitespace"
    elif "]" in path:
        problem = "']' without '[' (globs have no bracket classes)"
    elif "***" in path:
        problem = "'***' (use '*' inside a segment or '**' across segments)"
    elif path.startswith("/") or path.endswith("/") or "//" in path:
        problem = "an empty path segment ('/' at the start or end, or '//')"
    if problem:
        raise PlanError(
            f"bad glob {s!r}: {problem}. Paths look like 'encoder/dense/kernel'; "
            "'*' matches within one segment, '**' across segments."
        )
    return Glob(path, re.compile(glob_to_regex(path))), suffix
