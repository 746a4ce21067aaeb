"""The grouped summary: one row per run of blocks or layers that share a state.

A per-variable table of a real model runs to hundreds of lines (ResNet50:
320 variables). Grouped, the blocks :func:`finefreeze.blocks` finds are
collapsed run by run (``conv4_block1…6  frozen``), the layers outside
blocks are listed by layer, and neighbouring rows with one state are merged
until the table fits :data:`MAX_ROWS` rows. Every line stays within
:data:`WIDTH` characters. The per-variable detail stays in ``report()``.
"""

from __future__ import annotations

import re

from finefreeze._resolve.blocks import blocks, layers_under

__all__ = [
    "batchnorm_line",
    "build_groups",
    "format_groups",
    "partial_label",
    "wants_detail",
    "MAX_ROWS",
    "SCREEN",
    "WIDTH",
]

MAX_ROWS = 30
SCREEN = 40
WIDTH = 120
_INDEX = re.compile(r"\d+[a-z]?$")


def _block_of_owner(model) -> dict[int, tuple[str, str]]:
    """``{id(layer): (block name, stage)}`` for every layer inside a block."""
    out: dict[int, tuple[str, str]] = {}
    found = blocks(model)
    if not found:
        return out
    by_name = {x.name: x for x in [model, *layers_under(model)]}
    for b in found:
        for name in b.layers:
            layer = by_name.get(name)
            if layer is None:
                continue
            for x in [layer, *layers_under(layer)]:
                out.setdefault(id(x), (b.name, b.stage))
    return out


def partial_label(pct: float) -> str:
    """``partial 42.0% frozen``; never 0.0 % or 100.0 % for a part that is neither all trained nor all frozen."""
    shown = f"{pct:.1f}"
    if shown == "100.0":
        shown = ">99.9"
    elif shown == "0.0":
        shown = "<0.1"
    return f"partial {shown}% frozen"


def _state(row) -> str:
    if row["trainable_elements"] and row["frozen_elements"]:
        return partial_label(100.0 * row["frozen_elements"] / (row["trainable_elements"] + row["frozen_elements"]))
    if row["trainable_elements"]:
        return "trainable"
    return "frozen" if row["frozen_elements"] else "untrained"


def build_groups(frz, rep: dict) -> list[dict]:
    """Rows of the grouped view: name, kind (``blocks`` or ``layers``), members and element counts.

    Args:
        frz: the :class:`Freezer`.
        rep: its report (per-variable rows).

    Returns:
        A list of JSON-able dicts, model order.
    """
    res = frz._res
    obj = res.target.obj
    in_block = _block_of_owner(obj) if res.target.kind == "keras" else {}
    rows: list[dict] = []
    for s, v in zip(res.states, rep["variables"]):
        hit = in_block.get(id(s.info.owner))
        if hit:
            key, stage, kind = hit[0], hit[1], "blocks"
        else:
            key = v["layer"] or "(root)"
            stage, kind = None, "layers"
        if not rows or rows[-1]["members"][-1] != key or rows[-1]["kind"] != kind:
            rows.append(
                {
                    "kind": kind,
                    "stage": stage,
                    "members": [key],
                    "elements": 0,
                    "trainable_elements": 0,
                    "frozen_elements": 0,
                    "optimizer_state_elements": 0,
                    "strategies": [],
                }
            )
        row = rows[-1]
        row["elements"] += v["elements"]
        row["trainable_elements"] += v["trainable_elements"]
        row["frozen_elements"] += v["frozen_elements"]
        row["optimizer_state_elements"] += v["optimizer_state_elements"]
        if v["strategy"] and v["strategy"] not in row["strategies"]:
            row["strategies"].append(v["strategy"])
    for row in rows:
        row["state"] = _state(row)
    rows = _merge(rows, lambda a, b: a["kind"] == b["kind"] == "blocks" and a["stage"] == b["stage"])
    rows = _merge(rows, lambda a, b: a["kind"] == b["kind"] and _token(a) == _token(b))
    while len(rows) > MAX_ROWS:
        merged = _merge(rows, lambda a, b: True)
        if len(merged) == len(rows):
            break
        rows = merged
    for row in rows:
        row["name"] = _label(row["members"])
    return rows


def wants_detail(rep: dict, variables: bool = True) -> bool:
    """Whether the detailed table fits :data:`SCREEN` rows (the default view then)."""
    rows = len(rep["layers"]) + (len(rep["variables"]) if variables else 0)
    return rows <= SCREEN


_BATCHNORM = {
    "frozen": "gamma/beta frozen, statistics fixed, inference mode",
    "train": "gamma/beta trained, statistics updated, training mode (also inside frozen parts)",
    "stats": "gamma/beta frozen, statistics updated, training mode",
    "affine": "gamma/beta trained (also inside frozen parts), statistics fixed, inference mode",
}


def batchnorm_line(option: str) -> str:
    """The summary line of a plan's ``batchnorm`` option ('' for ``keras``)."""
    return f"BatchNormalization (batchnorm={option!r}): {_BATCHNORM[option]}" if option in _BATCHNORM else ""


def _token(row) -> str:
    return row["members"][0].split("/")[-1].split("_")[0]


def _merge(rows, fits) -> list[dict]:
    out: list[dict] = []
    for row in rows:
        last = out[-1] if out else None
        if last is not None and last["state"] == row["state"] and fits(last, row):
            for k in ("elements", "trainable_elements", "frozen_elements", "optimizer_state_elements"):
                last[k] += row[k]
            last["members"] += [m for m in row["members"] if m not in last["members"]]
            last["strategies"] += [x for x in row["strategies"] if x not in last["strategies"]]
            if last["stage"] != row["stage"]:
                last["stage"] = None
            continue
        out.append(dict(row, members=list(row["members"]), strategies=list(row["strategies"])))
    return out


def _label(members: list[str]) -> str:
    """``conv4_block1…6`` for a run of numbered names, ``first…last`` otherwise."""
    if len(members) == 1:
        return members[0]
    first, last = members[0], members[-1]
    a, b = _INDEX.search(first), _INDEX.search(last)
    if a and b and first[: a.start()] == last[: b.start()]:
        return f"{first}…{b.group()}"
    return f"{first}…{last}"


def _short(n: int) -> str:
    for unit, k in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return str(n)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _frozen_layers(rep: dict) -> str:
    """``47 layers in conv1_bn, conv2_block1…3, ...``: frozen layers named by their group."""
    names = [p.split("/")[-1] for p in rep["frozen_layers"]]
    where = []
    for g in rep["groups"]:
        if any(n == m or n.startswith(m + "_") for n in names for m in g["members"]):
            where.append(g["name"])
    return f"{len(names)} layers in {', '.join(where)}" if where else ", ".join(names)


def format_groups(rep: dict) -> str:
    """The grouped table of a report, at most :data:`WIDTH` characters wide.

    Args:
        rep: a report with ``groups`` (``Freezer.report()``).

    Returns:
        The table as a string.
    """
    label = rep.get("optimizer_state", "Adam state")
    head = ("Group", "Layers", "Elements", "Trainable", "Frozen", "State", _cut(label, 16))
    body = []
    for g in rep["groups"]:
        state = g["state"] + (f" [{', '.join(g['strategies'])}]" if g["strategies"] else "")
        body.append(
            (
                _cut(g["name"], 40),
                str(len(g["members"])),
                _short(g["elements"]),
                _short(g["trainable_elements"]),
                _short(g["frozen_elements"]),
                _cut(state, 30),
                _short(g["optimizer_state_elements"]),
            )
        )
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(r):
        return "  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    bar = "─" * min(WIDTH, sum(widths) + 2 * (len(widths) - 1))
    t = rep["totals"]
    pct = 100.0 * t["trainable_elements"] / max(1, t["elements"] - t["untrained_elements"])
    rules = ", ".join(rep["plan"]) or "no rules (every variable as Keras trains it)"
    out = [_cut("Freeze plan: " + rules, WIDTH), bar, line(head), bar, *map(line, body), bar]
    if rep.get("batchnorm"):
        out.insert(1, rep["batchnorm"])
    out.append(f"Trainable elements: {t['trainable_elements']:,} ({pct:.2f}% of what Keras trains)")
    out.append(f"Frozen elements: {t['frozen_elements']:,}; not trained by Keras: {t['untrained_elements']:,}")
    out.append(f"Optimizer {label}: {t['optimizer_state_elements']:,} elements")
    if rep["frozen_layers"]:
        out.append(_cut(f"Frozen as layers (inference mode): {_frozen_layers(rep)}", WIDTH))
    for g in rep.get("lr_scales", []):
        out.append(
            _cut(f"Learning-rate scale {g['lr_scale']:g} for {g['elements']:,} elements: rule {g['rule']}", WIDTH)
        )
    out.append("Per-variable detail: summary(detail=True), or report()['variables'].")
    return "\n".join(out)
