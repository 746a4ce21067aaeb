"""Plans: an ordered, immutable list of rules; the last rule that selects an
element decides it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from finefreeze._errors import PlanError
from finefreeze._plan.packed import decode_mask
from finefreeze._plan.planfile import read_plan_file, write_plan_file
from finefreeze._plan.rules import Rule, freeze, train

__all__ = ["Plan", "BATCHNORM"]

#: Values of ``Plan(batchnorm=...)``.
BATCHNORM = ("keras", "frozen", "train", "stats", "affine")

_RULE_KEYS = {"mask", "indices", "lr_scale", "rows", "columns", "heads"}


class Plan:
    """An immutable, ordered list of :class:`Rule` objects.

    Args:
        rules: rules made with :func:`freeze` and :func:`train`.
        strict: when True, a rule that selects nothing is a ``PlanError``;
            when False it is a warning.
        batchnorm: what BatchNormalization layers do, whatever the rules say
            (see :data:`BATCHNORM`): ``"keras"`` (default: they follow the
            rules; one frozen whole runs in inference mode), ``"frozen"``
            (gamma/beta frozen, statistics fixed, inference mode: the
            fine-tuning recipe of the keras.io guide), ``"train"`` (gamma/beta
            trained and statistics updated even inside frozen parts:
            Lightning's ``train_bn``), ``"stats"`` (gamma/beta frozen,
            statistics keep updating in training mode), ``"affine"``
            (gamma/beta trained, statistics fixed, inference mode).

    Raises:
        PlanError: an entry of ``rules`` is not a ``Rule``.

    Example:
        >>> import finefreeze as ff
        >>> plan = ff.Plan([ff.freeze("**")]).train("head/**")
        >>> plan
        Plan([freeze('**'), train('head/**')])
        >>> ff.Plan.from_dict(plan.to_dict()) == plan
        True
    """

    __slots__ = ("_rules", "_strict", "_batchnorm")

    def __init__(self, rules: Iterable[Rule] = (), *, strict: bool = True, batchnorm: str = "keras"):
        rules = tuple(rules)
        for i, r in enumerate(rules):
            if not isinstance(r, Rule):
                raise PlanError(
                    f"Plan entry {i} is {type(r).__name__} {r!r}, not a rule; "
                    "build rules with ff.freeze(...) and ff.train(...)."
                )
        object.__setattr__(self, "_rules", rules)
        object.__setattr__(self, "_strict", bool(strict))
        if batchnorm not in BATCHNORM:
            raise PlanError(f"Plan(batchnorm={batchnorm!r}): choose one of {', '.join(map(repr, BATCHNORM))}.")
        object.__setattr__(self, "_batchnorm", batchnorm)

    def __setattr__(self, name, value):
        raise AttributeError("Plan is immutable; .freeze() and .train() return a new plan")

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules, in order."""
        return self._rules

    @property
    def strict(self) -> bool:
        """Whether a rule that selects nothing is an error."""
        return self._strict

    @property
    def batchnorm(self) -> str:
        """What BatchNormalization layers do: ``keras``, ``frozen``, ``train``, ``stats`` or ``affine``."""
        return self._batchnorm

    @property
    def all_rules(self) -> tuple[Rule, ...]:
        """The rules, then the one ``batchnorm`` adds (``freeze``/``train`` of every BatchNormalization)."""
        extra = {"frozen": freeze, "stats": freeze, "train": train, "affine": train}.get(self._batchnorm)
        return self._rules if extra is None else (*self._rules, extra({"layer_class": "BatchNormalization"}))

    def freeze(self, *args, **kwargs) -> Plan:
        """Return a new plan with ``ff.freeze(*args, **kwargs)`` appended."""
        return Plan(self._rules + (freeze(*args, **kwargs),), strict=self._strict, batchnorm=self._batchnorm)

    def train(self, *args, **kwargs) -> Plan:
        """Return a new plan with ``ff.train(*args, **kwargs)`` appended."""
        return Plan(self._rules + (train(*args, **kwargs),), strict=self._strict, batchnorm=self._batchnorm)

    def __add__(self, other: Plan) -> Plan:
        if not isinstance(other, Plan):
            return NotImplemented
        bn = self._batchnorm if other._batchnorm == "keras" else other._batchnorm
        return Plan(self._rules + other._rules, strict=self._strict and other._strict, batchnorm=bn)

    def __len__(self) -> int:
        return len(self._rules)

    def __iter__(self):
        return iter(self._rules)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (self._strict, self._batchnorm, self._rules) == (other._strict, other._batchnorm, other._rules)

    def __hash__(self):
        return hash((self._rules, self._strict, self._batchnorm))

    def __repr__(self) -> str:
        inner = ", ".join(repr(r) for r in self._rules)
        extra = "" if self._strict else ", strict=False"
        extra += "" if self._batchnorm == "keras" else f", batchnorm={self._batchnorm!r}"
        return f"Plan([{inner}]{extra})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"strict": bool, "rules": [{"freeze": "..."}, ...]}``.

        Raises:
            PlanError: a rule holds a callable, an instance or a variable.
        """
        d = {"strict": self._strict, "rules": [r.to_dict() for r in self._rules]}
        if self._batchnorm != "keras":
            d["batchnorm"] = self._batchnorm
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "plan") -> Plan:
        """Build a plan from :meth:`to_dict` output.

        Args:
            d: the mapping.
            source: named in error messages (a file name, say).

        Raises:
            PlanError: unknown keys, a rule with no or two actions, bad values.
        """
        if not isinstance(d, Mapping):
            raise PlanError(
                f"{source}: a plan is a mapping with 'rules' (and optionally 'strict'); got {type(d).__name__}."
            )
        unknown = set(d) - {"strict", "rules", "batchnorm"}
        if unknown:
            raise PlanError(
                f"{source}: unknown plan keys {sorted(unknown)}; a plan has 'rules', 'strict' and 'batchnorm'."
            )
        batchnorm = d.get("batchnorm", "keras")
        if batchnorm not in BATCHNORM:
            raise PlanError(
                f"{source}: 'batchnorm' must be one of {', '.join(map(repr, BATCHNORM))}, got {batchnorm!r}."
            )
        strict = d.get("strict", True)
        if not isinstance(strict, bool):
            raise PlanError(f"{source}: 'strict' must be true or false, got {strict!r}.")
        raw = d.get("rules", [])
        if not isinstance(raw, list):
            raise PlanError(f"{source}: 'rules' must be a list, got {type(raw).__name__}.")
        rules = []
        for i, r in enumerate(raw):
            where = f"{source}: rule {i + 1}"
            if not isinstance(r, Mapping):
                raise PlanError(f'{where}: each rule is a mapping like {{"freeze": "encoder/**"}}; got {r!r}.')
            actions = [k for k in ("freeze", "train") if k in r]
            if len(actions) != 1:
                raise PlanError(f"{where}: a rule has exactly one of 'freeze' or 'train'; got keys {sorted(r)}.")
            action = actions[0]
            extra = set(r) - {action} - _RULE_KEYS
            if extra:
                raise PlanError(
                    f"{where}: unknown keys {sorted(extra)}; allowed: {action}, {', '.join(sorted(_RULE_KEYS))}."
                )
            kwargs = {}
            if "mask" in r and isinstance(r["mask"], Mapping):
                kwargs["mask"] = decode_mask(r["mask"], where)
            elif "mask" in r:
                import numpy as np

                try:
                    kwargs["mask"] = (
                        np.asarray(r["mask"], dtype=bool) if _all_bool(r["mask"]) else np.asarray(r["mask"])
                    )
                except ValueError as e:
                    raise PlanError(f"{where}: mask is not a rectangular array: {e}") from None
            if "indices" in r:
                kwargs["indices"] = r["indices"]
            kwargs.update({word: r[word] for word in ("rows", "columns", "heads") if word in r})
            if "lr_scale" in r:
                if action != "train":
                    raise PlanError(f"{where}: lr_scale belongs to train rules only.")
                kwargs["lr_scale"] = r["lr_scale"]
            try:
                rules.append((freeze if action == "freeze" else train)(r[action], **kwargs))
            except PlanError as e:
                raise PlanError(f"{where}: {e}") from None
        return cls(rules, strict=strict, batchnorm=batchnorm)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to ``.json``, ``.toml`` or ``.yaml``/``.yml``.

        Raises:
            PlanError: unknown extension or a rule that cannot be written.
            ImportError: YAML without ``pip install finefreeze[yaml]``.
        """
        write_plan_file(self.to_dict(), os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan from ``.json``, ``.toml`` or ``.yaml``/``.yml``.

        Raises:
            PlanError: the file does not parse (file and line named) or holds
                a bad plan.
        """
        path = os.fspath(path)
        return cls.from_dict(read_plan_file(path), source=path)


def _all_bool(x) -> bool:
    if isinstance(x, bool):
        return True
    if isinstance(x, list):
        return all(_all_bool(v) for v in x)
    return False
