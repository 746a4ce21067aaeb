"""The freeze report: a JSON-able dict and a ``model.summary()``-like table."""

from __future__ import annotations

from finefreeze._enforce.policy import sparse_gradients
from finefreeze._report.groups import batchnorm_line, build_groups, partial_label
from finefreeze._report.state_size import optimizer_state
from finefreeze._resolve.resolve import FOLLOWS_LAYER, FROZEN, PARTIAL, TRAINABLE, UNTRAINED
from finefreeze._slices.choose import SAMPLED_KINDS, sliced_gradient

__all__ = ["build_report", "format_summary"]


#: the words of a report on a Keras target; a graph Freezer has its own (``words`` of the Freezer)
KERAS_WORDS = {
    "untouched": "keras state",
    "share": "of what Keras trains",
    "untrained": "Not trained by Keras (moving statistics etc.)",
}


def _decider(plan, idx: int, words: dict) -> str:
    if idx >= len(plan.rules):
        return f"batchnorm={plan.batchnorm!r}"
    if idx == FOLLOWS_LAYER:  # float8's scales and amax histories: their layer's state
        return "its layer"
    return words["untouched"] if idx < 0 else f"{idx + 1}: {plan.rules[idx]!r}"


_OWN = ("sliced", "sampled")  # gradients the summary tags


def _gradient(s) -> str:
    """How the variable's gradient is computed: ``sliced`` (its trained block only), ``sampled`` (its trained
    elements only), ``sparse`` or ``dense``."""
    ks = sliced_gradient(s.info.owner, s.variable) if s.state == PARTIAL else None
    if ks is None and sparse_gradients(s.info.owner):  # TensorFlow embeddings: the batch's rows (IndexedSlices)
        return "sparse"
    return "dense" if ks is None else "sampled" if ks.kind in SAMPLED_KINDS else "sliced"


def build_report(frz, words: dict = KERAS_WORDS) -> dict:
    """The report of ``frz``: one row per variable and per layer, totals, rules, history, groups."""
    res = frz._res
    plan = res.plan
    state_label, slots = optimizer_state(frz)
    variables = [_variable_row(frz, s, plan, slots, words) for s in res.states]
    rep = {
        "plan": [repr(r) for r in plan.rules],
        "optimizer_state": state_label,
        "batchnorm": batchnorm_line(plan.batchnorm),
        "lr_scales": _lr_scales(res, plan, words),
        "strategy": frz._strategy,
        "frozen_layers": [getattr(x, "path", None) or x.name for x in res.frozen_layers],
        "layers": _layer_rows(variables),
        "variables": variables,
        "totals": _totals(variables),
        "history": frz.history,
    }
    rep["groups"] = build_groups(frz, rep)
    return rep


def _variable_row(frz, s, plan, slots, words) -> dict:
    """One variable's row: its elements by state, strategy, gradient, optimizer state and deciding rules."""
    size = s.info.size
    strategy = frz._strategy_for(s.path) if s.state == PARTIAL else None
    if s.state == TRAINABLE:
        adam = 2 * size
    elif s.state == PARTIAL:
        adam = 2 * (s.n_trainable if strategy == "compact" else size)
    else:
        adam = 0
    return {
        "path": s.path,
        "layer": s.path.rsplit("/", 1)[0] if "/" in s.path else "",
        "shape": list(s.info.shape),
        "dtype": s.info.dtype,
        "elements": size,
        "trainable_elements": s.n_trainable,
        "frozen_elements": size - s.n_trainable if s.state != UNTRAINED else 0,
        "state": s.state,
        "strategy": strategy,
        "gradient": _gradient(s) if s.state in (PARTIAL, TRAINABLE) else None,
        # a quantized kernel (int8, int4): the logical shape above; what trains of it is a float delta beside it
        "quantized": s.info.quantized,
        "lr_scale": s.lr_scale,
        "adam_state_elements": adam,
        "optimizer_state_elements": adam // 2 * (2 if slots is None else slots),
        "decided_by": [{"rule": _decider(plan, i, words), "elements": n} for i, n in s.decided_by],
    }


_SUMMED = ("elements", "trainable_elements", "frozen_elements", "adam_state_elements", "optimizer_state_elements")


def _layer_rows(variables: list[dict]) -> list[dict]:
    """One row per layer: its variables' elements summed, and the layer's state."""
    layers: dict[str, dict] = {}
    for v in variables:
        row = layers.setdefault(
            v["layer"], {"layer": v["layer"], **dict.fromkeys(_SUMMED, 0), "untrained_elements": 0, "variables": []}
        )
        for key in _SUMMED:
            row[key] += v[key]
        row["untrained_elements"] += v["elements"] if v["state"] == UNTRAINED else 0
        row["variables"].append(v["path"])
    for row in layers.values():
        trainable = row["elements"] - row["untrained_elements"]
        if row["trainable_elements"] == 0:
            row["state"] = FROZEN if trainable else UNTRAINED
        elif row["frozen_elements"] == 0:
            row["state"] = TRAINABLE
        else:
            row["state"] = PARTIAL
    return [
        {k: row[k] for k in ("layer", *_SUMMED[:3], "untrained_elements", *_SUMMED[3:], "variables", "state")}
        for row in layers.values()
    ]


def _totals(variables: list[dict]) -> dict:
    return {
        "variables": len(variables),
        "elements": sum(v["elements"] for v in variables),
        "trainable_elements": sum(v["trainable_elements"] for v in variables),
        "frozen_elements": sum(v["frozen_elements"] for v in variables),
        "untrained_elements": sum(v["elements"] for v in variables if v["state"] == UNTRAINED),
        "adam_state_elements": sum(v["adam_state_elements"] for v in variables),
        "optimizer_state_elements": sum(v["optimizer_state_elements"] for v in variables),
        "by_state": {k: sum(1 for v in variables if v["state"] == k) for k in (TRAINABLE, PARTIAL, FROZEN, UNTRAINED)},
    }


def _lr_scales(res, plan, words) -> list[dict]:
    """The rules that scale the learning rate, with how many elements each decides."""
    decided: dict[int, int] = {}
    for st in res.states:
        for i, n in st.decided_by:
            decided[i] = decided.get(i, 0) + n
    return [
        {"rule": _decider(plan, i, words), "lr_scale": r.lr_scale, "elements": decided.get(i, 0)}
        for i, r in enumerate(plan.rules)
        if not r.freezes and r.lr_scale is not None and r.lr_scale != 1.0
    ]


def _fmt_state(v) -> str:
    if v["state"] == PARTIAL:
        return partial_label(100.0 * v["frozen_elements"] / max(1, v["elements"] - v.get("untrained_elements", 0)))
    return v["state"]


#: the width a summary aims at; longer texts end in an ellipsis (full text in ``report()``)
WIDTH = 132
_NAME_WIDTH = 40  # layer and variable names: longer ones lose their middle
_SHAPE_WIDTH = 20
_DECIDED_MIN = 20  # "Decided by" keeps at least this much even when other columns are wide


def _shorten(text: str, width: int, *, middle: bool = False) -> str:
    """``text`` cut to ``width`` characters with an ellipsis (in the middle for paths)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    if middle:
        first, sep, rest = text.partition("/")
        if sep and len(first) + 3 < width:  # a path keeps its first part (``block_3/…``) whole: rows stay apart
            tail = rest.split("/")
            while len(tail) > 1 and len(first) + 3 + len("/".join(tail)) > width:
                tail.pop(0)
            kept = "/".join(tail)
            if len(first) + 3 + len(kept) <= width:
                return f"{first}/…/{kept}"
            return f"{first}/…" + kept[len(kept) - (width - len(first) - 2) :]
        head = (width - 1) // 2
        return text[:head] + "…" + text[len(text) - (width - 1 - head) :]
    return text[: width - 1] + "…"


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _rule_numbers(deciders) -> str:
    """``"1, 3"`` for the rules (numbered as in the plan legend) that decided some elements.

    Elements no rule selects are named by their owner's state: ``keras`` (or
    ``graph`` for a ``tf.compat.v1`` graph's ``graph state``).
    """
    out = []
    for d in deciders:
        number, sep, _ = d["rule"].partition(": ")
        out.append(number if sep and number.isdigit() else d["rule"].removesuffix(" state"))
    return ", ".join(_unique(out))


_LEGEND_RULES = 20  # rules listed above the table; the rest are counted


def format_summary(rep: dict, *, variables: bool = True, words: dict = KERAS_WORDS) -> str:
    """The summary table of a report: the plan, one row per layer (and variable), totals, plan changes."""
    label = rep.get("optimizer_state", "Adam state")
    head = ("Layer / variable", "Shape", "Elements", "Trainable", "Frozen", "State", label, "Decided by")
    rows = _summary_rows(rep, variables)
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    widths[1] = min(widths[1], _SHAPE_WIDTH)
    widths[-1] = min(widths[-1], max(_DECIDED_MIN, WIDTH - sum(widths[:-1]) - 2 * (len(widths) - 1)))

    def line(r):
        cells = [_shorten(str(c), widths[i]) for i, c in enumerate(r)]
        return "  ".join(
            c.ljust(w) if i in (0, 1, 5, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    rule = "─" * min(WIDTH, sum(widths) + 2 * (len(widths) - 1))
    out = ["Freeze plan:" + ("" if rep["plan"] else " no rules (every variable as Keras trains it)")]
    out += [_shorten(f"  {i + 1}: {r}", WIDTH) for i, r in enumerate(rep["plan"][:_LEGEND_RULES])]
    if len(rep["plan"]) > _LEGEND_RULES:
        out.append(f"  … and {len(rep['plan']) - _LEGEND_RULES} more rules (all in report()['plan'])")
    out += [rule, line(head), rule]
    if rep.get("batchnorm"):
        out.insert(1, rep["batchnorm"])
    out += [line(r) for r in rows]
    out.append(rule)
    return "\n".join(out + _summary_footer(rep, label, words))


def _summary_rows(rep: dict, variables: bool) -> list[tuple]:
    """The table's rows: each layer, then (``variables``) each of its variables."""
    by_path = {v["path"]: v for v in rep["variables"]}
    rows = []
    for layer in rep["layers"]:
        own = [by_path[p] for p in layer["variables"]]
        n = len(own)
        rows.append(
            (
                _shorten(layer["layer"] or "(root)", _NAME_WIDTH, middle=True),
                f"{n} variable{'s' if n != 1 else ''}",
                f"{layer['elements']:,}",
                f"{layer['trainable_elements']:,}",
                f"{layer['frozen_elements']:,}",
                _fmt_state(layer),
                f"{layer['optimizer_state_elements']:,}",
                _rule_numbers(d for v in own for d in v["decided_by"]),
            )
        )
        for v in own if variables else ():
            delta = v.get("quantized") and v["quantized"] + (" + float delta" if v["state"] != "frozen" else "")
            tag = ", ".join(t for t in (v["strategy"], v["gradient"] if v["gradient"] in _OWN else None, delta) if t)
            rows.append(
                (
                    "  " + _shorten(v["path"].rsplit("/", 1)[-1], _NAME_WIDTH - 2, middle=True),
                    str(tuple(v["shape"])),
                    f"{v['elements']:,}",
                    f"{v['trainable_elements']:,}",
                    f"{v['frozen_elements']:,}",
                    _fmt_state(v) + (f" [{tag}]" if tag else ""),
                    f"{v['optimizer_state_elements']:,}",
                    _rule_numbers(v["decided_by"]),
                )
            )
    return rows


def _summary_footer(rep: dict, label: str, words: dict) -> list[str]:
    """The lines under the table: totals, layers frozen whole, learning-rate scales, plan changes."""
    t = rep["totals"]
    pct = 100.0 * t["trainable_elements"] / max(1, t["elements"] - t["untrained_elements"])
    out = [
        f"Trainable elements: {t['trainable_elements']:,} ({pct:.2f}% {words['share']})",
        f"Frozen elements:    {t['frozen_elements']:,}",
        f"{words['untrained']}: {t['untrained_elements']:,}",
        f"Optimizer {label}: {t['optimizer_state_elements']:,} elements",
    ]
    if rep["frozen_layers"]:
        names = rep["frozen_layers"]
        text = f"Frozen as layers (inference mode): {', '.join(names)}"
        if len(text) > WIDTH:
            tail = f" ({len(names)} layers; all in report()['frozen_layers'])"
            text = _shorten(text, WIDTH - len(tail)) + tail
        out.append(text)
    for g in rep.get("lr_scales", []):
        out.append(
            _shorten(f"Learning-rate scale {g['lr_scale']:g} for {g['elements']:,} elements: rule {g['rule']}", WIDTH)
        )
    history = rep.get("history", [])
    if len(history) > 1:
        out.append("Plan changes:")
        for h in history:
            how = "retraced" if h["retraced"] else "no retrace"
            out.append(
                _shorten(
                    f"  step {h['step']:>6} ({h['time']}): {h['trainable_elements']:,} trainable "
                    f"elements [{how}]: {', '.join(h['plan'])}",
                    WIDTH,
                )
            )
    return out
