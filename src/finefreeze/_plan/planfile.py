"""Reading and writing plan files (.json, .toml, .yaml); YAML is optional."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from finefreeze._errors import PlanError

__all__ = ["read_plan_file", "write_plan_file"]


def _ext(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".toml", ".yaml", ".yml"):
        raise PlanError(f"plan file {path!r}: unknown extension {ext!r}; use .json, .toml, .yaml or .yml.")
    return ext


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ImportError("YAML plan files need PyYAML: pip install 'finefreeze[yaml]'") from None
    return yaml


def read_plan_file(path: str) -> Any:
    ext = _ext(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PlanError(f"plan file {path!r} cannot be read: {e.strerror}.") from None
    if ext == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}:{e.lineno}:{e.colno}: JSON does not parse: {e.msg}.") from None
    if ext == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            import re

            line = getattr(e, "lineno", None)
            m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
            if line is None and m:
                line = int(m.group(1))
            where = f"{path}:{line}" if line else path
            msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", getattr(e, "msg", None) or str(e))
            raise PlanError(f"{where}: TOML does not parse: {msg}.") from None
    yaml = _yaml()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e)
        raise PlanError(f"{where}: YAML does not parse: {problem}.") from None


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise PlanError(f"cannot write {v!r} to TOML")


def write_plan_file(d: dict, path: str) -> None:
    ext = _ext(path)
    if ext == ".json":
        text = json.dumps(d, indent=2) + "\n"
    elif ext == ".toml":
        # every top-level key (strict, batchnorm, ...) before the rule tables
        lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if k != "rules"] + [""]
        for r in d["rules"]:
            lines.append("[[rules]]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in r.items()]
            lines.append("")
        text = "\n".join(lines)
    else:
        text = _yaml().safe_dump(d, sort_keys=False)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
