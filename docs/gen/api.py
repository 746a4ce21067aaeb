"""The API reference, from the docstrings of every public symbol.

Writes docs/api.md:  python docs/gen/api.py --write
(``tests/test_docs.py`` checks the committed page is what this prints.)
"""

import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import finefreeze as ff  # noqa: E402


def public_symbols():
    """``[(qualified name, object)]`` for ``ff.__all__`` and the names of its public submodules."""
    out = []
    for name in ff.__all__:
        obj = getattr(ff, name)
        if name == "__version__":
            continue
        if inspect.ismodule(obj):
            out += [(f"ff.{name}.{sub}", getattr(obj, sub)) for sub in obj.__all__]
        else:
            out.append((f"ff.{name}", obj))
    return out


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p for n, p in sig.parameters.items() if not n.startswith("_")]
    return str(sig.replace(parameters=params))


def _members(cls):
    """Own and inherited members of finefreeze classes (a base's first), the most derived definition of each."""
    mro = [c for c in reversed(cls.__mro__) if c.__module__.startswith("finefreeze")]
    names = list(dict.fromkeys(n for c in mro for n in vars(c)))
    for name in names:
        yield name, next(vars(c)[name] for c in cls.__mro__ if name in vars(c))


def _methods(cls):
    for name, member in _members(cls):
        if isinstance(member, classmethod):
            member = member.__func__
        if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
            continue
        doc = inspect.cleandoc(member.__doc__) if member.__doc__ else None  # its own, not inherited
        if doc:
            sig = (
                ""
                if isinstance(member, property)
                else _signature(member)
                .replace("(self, ", "(")
                .replace("(self)", "()")
                .replace("(cls, ", "(")
                .replace("(cls)", "()")
            )
            yield name, sig, doc.splitlines()[0]


def page() -> str:
    out = [
        "# API reference",
        "",
        f"finefreeze {ff.__version__}. Generated from the docstrings by `python docs/gen/api.py --write`;",
        "every example in them runs as a doctest in CI. Import as `import finefreeze as ff`.",
        "",
    ]
    for qual, obj in public_symbols():
        doc = inspect.getdoc(obj) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ")
        kind = "class" if inspect.isclass(obj) else "function"
        sig = _signature(obj) if kind == "function" or not issubclass(obj, BaseException) else ""
        out += [f"## `{qual}{sig}`", "", f"*{kind}* — {summary}", ""]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            rows = list(_methods(obj))
            if rows:
                out += ["| member | summary |", "|---|---|"]
                out += [f"| `{n}{s}` | {d} |" for n, s, d in rows]
                out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    from _page import page_main

    page_main(__doc__, "api.md", page)
