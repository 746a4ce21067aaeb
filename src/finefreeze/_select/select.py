"""``select``: choose from data which elements to train, as an ordinary plan."""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._errors import PlanError
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import freeze, train
from finefreeze._resolve.blocks import blocks
from finefreeze._resolve.resolve import FROZEN, UNTRAINED, closest, resolve
from finefreeze._resolve.targets import collect
from finefreeze._select.arguments import check_arguments, check_budget, check_options, count_of
from finefreeze._select.scores import DATA_SCORES, static_score, stream_scores
from finefreeze._select.structure import choose_slices, slice_axis

__all__ = ["FISHER_MEMORY", "auto_microbatch", "select", "top_k", "split_budget"]

#: ``select(..., options={"microbatch": "auto"})``: the bytes of float32 per-example gradients ``fisher`` holds at once
FISHER_MEMORY = 256 * 2**20


def auto_microbatch(scored: int) -> int:
    """Examples per vectorised per-example gradient: as many as fit :data:`FISHER_MEMORY`, 1 to 16.

    Args:
        scored: elements of the scored variables (each example's gradient holds them all).

    Returns:
        The microbatch, between 1 and 16.

    Example:
        >>> auto_microbatch(1_000_000), auto_microbatch(150_000_000)
        (16, 1)
    """
    return max(1, min(16, FISHER_MEMORY // (4 * max(1, int(scored)))))


def _keys(a: np.ndarray) -> np.ndarray:
    """uint32 keys whose order is the float32 order of ``a`` (no NaN)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    neg = (u >> 31).astype(bool)
    return np.where(neg, ~u, u | np.uint32(0x80000000))


def top_k(scores: list[np.ndarray], allowed: list[np.ndarray], k: int) -> list[np.ndarray]:
    """Bool masks of the ``k`` largest allowed scores over all arrays together.

    Ties go to the earlier array, then the lower flat index. Works on one
    array at a time (a binary search on the threshold), so it never builds a
    second copy of all scores.
    """
    lo, hi = 0, 2**32 - 1  # find the largest key T with count(key >= T) >= k

    def count(t):
        return sum(int(np.count_nonzero((_keys(s) >= t) & m)) for s, m in zip(scores, allowed))

    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(np.uint32(mid)) >= k:
            lo = mid
        else:
            hi = mid - 1
    t = np.uint32(lo)
    out, left = [], k - sum(int(np.count_nonzero((_keys(s) > t) & m)) for s, m in zip(scores, allowed))
    for s, m in zip(scores, allowed):
        key = _keys(s)
        chosen = (key > t) & m
        if left > 0:
            eq = np.flatnonzero(((key == t) & m).ravel())[:left]
            chosen.ravel()[eq] = True
            left -= len(eq)
        out.append(chosen)
    return out


def split_budget(k: int, sizes: list[int]) -> list[int]:
    """Split ``k`` elements over variables in proportion to ``sizes`` (largest remainders; exact sum)."""
    total = sum(sizes)
    exact = [k * n / total for n in sizes]
    quota = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - quota[i]), i))
    for i in order[: k - sum(quota)]:
        quota[i] += 1
    return quota


def _selected(selectors, target, what: str) -> dict[str, np.ndarray]:
    """Per variable path, the elements the selectors pick (bool arrays); strict."""
    if selectors is None:
        return {}
    sels = selectors if isinstance(selectors, (list, tuple)) else [selectors]
    try:
        res = resolve(Plan([freeze("**")] + [train(s) for s in sels]), target, selecting=True)
    except PlanError as e:
        raise PlanError(f"select: {what}= {e}") from None
    return {s.path: ~s.frozen_mask() for s in res.states if s.state not in (UNTRAINED, FROZEN)}


def rule_selector(path: str) -> str:
    return "re:" + re.escape(path) if any(c in path for c in "*?[]") else path


def select(
    model: keras.Model,
    data: Any = None,
    *,
    budget: float | int | str,
    score: str = "fisher",
    include: Any = None,
    exclude: Any = None,
    loss: Any = None,
    structure: str = "elements",
    spread: str | Mapping[Any, float] = "model",
    batch_size: int = 32,
    batches: int | None = None,
    options: dict[str, Any] | None = None,
) -> Plan:
    """Choose which elements to train from a score, and return them as a plan.

    The candidates are the elements Keras would train, minus ``include`` and
    ``exclude``. Each candidate gets a score; the ``budget`` highest are
    trained, plus everything ``include`` selects; the rest is frozen.
    Scores: ``"fisher"`` (sum over examples of the squared per-example
    gradient, FISH masks), ``"gradient"`` (sum over batches of the absolute
    batch gradient), ``"magnitude"`` (|w|), ``"delta"`` (|θ − θ₀| after
    training on ``data``, LT-SFT; the model's variables are then assigned
    back, bit for bit), ``"random"`` (seeded). Scores are reduced per
    variable while batches stream (one float32 accumulator per scored
    element; ``fisher`` also holds a microbatch of gradients at a time) and
    computed in inference mode (``training=False``). Ties go to the earlier
    variable, then the lower flat index. Every score runs on the TensorFlow,
    JAX and PyTorch backends, with the same results to float rounding.

    Args:
        model: a built Keras model.
        data: ``(x, y)`` arrays, a ``tf.data.Dataset`` of ``(x, y)`` batches, or
            an iterable of them; not needed for ``magnitude`` and ``random``.
        budget: how many candidates to train: a fraction (a float in (0, 1],
            or a percent string such as ``"1%"`` or ``"0.5%"``; rounded half
            up, at least 1) or a count of elements (an int >= 1). A count of
            1 to 100 looks like a percent: it selects that many elements and
            warns (``FreezeWarning``); write 1 % as ``0.01`` or ``"1%"``.
        score: one of ``fisher``, ``gradient``, ``magnitude``, ``delta``, ``random``.
        include: selector(s) (as in rules) trained in full, on top of the budget.
        exclude: selector(s) never chosen.
        loss: the loss for the scores; default the model's compiled loss.
        structure: ``"elements"``, or whole slices by their mean score:
            ``"rows"``, ``"columns"``, ``"channels"`` or ``"heads"``
            (:mod:`finefreeze._select.structure`); a kernel that trains
            slices gets their weight gradient only (docs/strategies.md).
        spread: how the budget is split before the best are taken, each
            group getting a quota (largest remainders; the quotas add up to
            the budget) and its own top-k:

            - ``"model"``: one group, one top-k over every candidate;
            - ``"variable"``: each variable a quota in proportion to its candidates;
            - ``"kind"``: each kind of variable (the same path in every
              block of ``ff.blocks(model)``: every ``query/kernel``, say; a
              variable outside the blocks is a kind of its own) a quota in
              proportion to its candidates;
            - ``"block"``: each block a quota in proportion to its
              candidates, each variable outside the blocks one of its own;
            - a dict ``{selector: share}``: the variables each selector
              picks (the first that picks a variable has it) get that share
              of the budget (shares are normalised); candidates no selector
              picks are not chosen.

            For a decoder LM, ``spread="kind"`` with the token table
            excluded spreads the budget over every projection of every block
            (docs/llm.md); ``"model"`` puts most of it where the scores are
            largest, often the tied table.
        batch_size: batch size when ``data`` is arrays.
        batches: use at most this many batches (per epoch for ``delta``).
        options: the rarely set knobs, a dict of some of:

            - ``largest`` (``True``): for ``magnitude``, the largest weights
              (``False``: the smallest).
            - ``microbatch`` (``"auto"``): examples per vectorised
              per-example gradient (``fisher``); they hold ``microbatch``
              gradients of every scored element at once, the memory that
              bounds ``fisher``. ``"auto"``: as many as
              :data:`FISHER_MEMORY` bytes of float32 gradients hold, 1 to 16.
            - ``per_example`` (``"auto"``): how ``fisher`` takes per-example
              gradients: ``"vectorized"`` (``tf.vectorized_map``,
              ``jax.vmap``, ``torch.func.vmap``), ``"loop"`` (one example
              after the other: slower on TensorFlow and PyTorch, faster on
              JAX on a CPU for dense models), or ``"auto"``: vectorised,
              except the loop for models with a ``MultiHeadAttention`` or
              ``Softmax`` layer on TensorFlow (KerasHub's attention too:
              their vectorised gradient crashes TensorFlow 2.21) and, on
              TensorFlow and PyTorch, from the first microbatch the
              vectorised gradient fails on.
            - ``epochs`` (``1``): passes over the data for ``delta``.
            - ``optimizer`` (``None``): a fresh Keras optimizer for
              ``delta`` (``None``: ``Adam(1e-3)``).
            - ``seed`` (``0``): seed of ``random``.
            - ``verbose`` (``1``): 1 shows a progress bar over the
              calibration batches, 0 nothing.

    Returns:
        ``Plan([freeze("**"), train(include)..., train(path, mask=chosen)...])``.

    Raises:
        PlanError: a bad budget (a bool, 0 or less, a float outside (0, 1],
            a string that is not a percent, a count above the candidates),
            an unknown key or a value of the wrong type in ``options`` (named,
            with the valid keys), an unknown score, a selector that selects
            nothing, data in no known form, no loss, a score that is NaN, a
            data score on a backend other than TensorFlow, JAX and PyTorch,
            ``per_example="vectorized"`` on a model PyTorch's ``vmap`` cannot
            batch. Nothing is computed and the model is unchanged.

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
        ...                       keras.layers.Dense(2, name="head")], name="net")
        >>> plan = ff.select(m, budget="20%", score="magnitude", include="**/head/**",
        ...                  options={"largest": False})
        >>> frz = ff.Freezer(m, plan)
        >>> frz.report()["totals"]["trainable_elements"]  # 3 of a's 15 (the smallest |w|) + the head's 8
        11
    """
    opts = check_options(options)
    wanted = check_budget(budget)
    batch_size, batches = check_arguments(score, data, batch_size, batches, structure)
    cand, allowed = _candidates(model, include, exclude)
    k = count_of(wanted, int(sum(np.count_nonzero(m) for m in allowed)), budget)
    groups = _groups(spread, model, cand, allowed, k)
    microbatch = opts["microbatch"]
    if microbatch == "auto":
        microbatch = auto_microbatch(sum(vi.size for vi in cand))
    if score in DATA_SCORES:
        run = dict(score=score, loss=loss, batch_size=batch_size, limit=batches, microbatch=microbatch)
        run.update({k: opts[k] for k in ("per_example", "epochs", "optimizer", "verbose")})
        scores = _data_scores(model, cand, data, run)
    else:
        rng = np.random.default_rng(opts["seed"])
        scores = [static_score(score, to_numpy(vi.variable), largest=opts["largest"], rng=rng) for vi in cand]
    for vi, s in zip(cand, scores):
        if np.isnan(s).any():
            raise PlanError(
                f"select: the {score} score of {vi.path} (shape {vi.shape}) has NaN; check the data and the loss."
            )
    chosen = _choose(scores, allowed, [slice_axis(structure, vi.shape, vi.owner) for vi in cand], k, structure, groups)
    rules = [freeze("**")]
    if include is not None:
        rules += [train(s) for s in (include if isinstance(include, (list, tuple)) else [include])]
    for vi, c in zip(cand, chosen):
        if c.all():
            rules.append(train(rule_selector(vi.path)))
        elif c.any():
            rules.append(train(rule_selector(vi.path), mask=c))
    return Plan(rules)


def _candidates(model, include, exclude) -> tuple[list, list[np.ndarray]]:
    """The variables with elements to choose from, and those elements (bool arrays): Keras trains them,
    ``include`` and ``exclude`` do not name them."""
    target = collect(model)
    inc = _selected(include, target, "include")
    exc = _selected(exclude, target, "exclude")
    cand, allowed = [], []
    for vi in target.variables:
        if not vi.base_trainable or vi.overwritten:  # float8's statistics: no weights, they follow their layer
            continue
        if vi.quantized is not None:
            raise PlanError(
                f"select: {vi.path!r} is an {vi.quantized}-quantized kernel (logical shape {vi.shape}): select "
                "scores elements by their float gradients, which integers do not have (and Keras' quantized calls "
                "take no per-example gradient on every backend). Select on the float model before quantize(): "
                "the plan it returns applies after it."
            )
        m = np.ones(vi.shape, bool)
        for d in (inc, exc):
            if vi.path in d:
                m &= ~d[vi.path]
        if m.any():
            cand.append(vi)
            allowed.append(m)
    if not cand:
        raise PlanError("select: no element is left to choose from after include= and exclude=.")
    return cand, allowed


def _data_scores(model, cand, data, run: dict) -> list[np.ndarray]:
    """The scores of ``cand`` from ``data`` (:func:`stream_scores`); data the model cannot take is a PlanError."""
    try:
        return stream_scores(model, [vi.variable for vi in cand], data, **run)
    except PlanError:
        raise
    except (ValueError, TypeError) as e:  # data that does not fit the model, as Keras says it
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # Keras colours its messages
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        said = [ln for ln in lines if re.search(r"expected|incompatible|shape", ln)]  # what Keras says is off
        first = (said or lines or [type(e).__name__])[0][:200]
        raise PlanError(
            f"select: the data does not fit the model ({first}); pass (x, y) batches the model takes, as for fit."
        ) from None


SPREADS = ("model", "variable", "kind", "block")


def _groups(spread, model, cand, allowed, k: int) -> list[tuple[list[int], int]]:
    """``spread`` as groups of candidates with their quotas: ``[(candidate indices, quota)]``, quotas adding up to k.

    Raises:
        PlanError: an unknown spread, a selector of a dict that picks no candidate, a share that is not a
            number > 0, a quota above its group's candidates.
    """
    sizes = [int(np.count_nonzero(m)) for m in allowed]
    if isinstance(spread, Mapping):
        return _shared(spread, model, cand, sizes, k)
    if not isinstance(spread, str) or spread not in SPREADS:
        raise PlanError(
            f"select: spread={spread!r}; choose one of {', '.join(map(repr, SPREADS))} or a dict "
            "{selector: share} (e.g. {'**/attention/**': 1, '**/ffw*/**': 1})."
        )
    if spread == "model":
        return [(list(range(len(cand))), k)]
    keys = [vi.path for vi in cand]
    if spread in ("kind", "block"):
        found = blocks(model) if isinstance(model, keras.layers.Layer) else []
        for b in found:
            picked = _selected(b.selector, collect(model), "spread")
            for i, vi in enumerate(cand):
                if vi.path in picked:
                    keys[i] = vi.path.replace(b.name, "{block}", 1) if spread == "kind" else b.name
    order = list(dict.fromkeys(keys))
    members = [[i for i, key in enumerate(keys) if key == g] for g in order]
    quotas = split_budget(k, [sum(sizes[i] for i in m) for m in members])
    return list(zip(members, quotas))


def _shared(spread: Mapping, model, cand, sizes: list[int], k: int) -> list[tuple[list[int], int]]:
    """The groups of a ``{selector: share}`` spread (see :func:`_groups`)."""
    target = collect(model)
    taken: set[int] = set()
    members, shares = [], []
    for selector, share in spread.items():
        if isinstance(share, (bool, np.bool_)) or not isinstance(share, numbers.Real) or not share > 0:
            raise PlanError(f"select: spread[{selector!r}] = {share!r}; a share is a number > 0.")
        try:
            picked = _selected(selector, target, "spread")
        except PlanError:
            paths = [vi.path for vi in cand]
            raise PlanError(
                f"select: spread's selector {selector!r} selects no variable of the model; candidates are "
                f"{', '.join(closest(str(selector), paths))}, ... Fix the selector or drop it."
            ) from None
        m = [i for i, vi in enumerate(cand) if vi.path in picked and i not in taken]
        if not m:
            raise PlanError(
                f"select: spread's selector {selector!r} picks no candidate (after include=, exclude= and the "
                "selectors before it); drop it or fix it."
            )
        taken.update(m)
        members.append(m)
        shares.append(float(share))
    quotas = split_budget(k, shares)
    for selector, m, q in zip(spread, members, quotas):
        n = sum(sizes[i] for i in m)
        if q > n:
            raise PlanError(
                f"select: spread gives {selector!r} {q:,} of the budget's {k:,} elements, but it has {n:,} "
                "candidates; lower its share or the budget."
            )
    return list(zip(members, quotas))


def _choose(scores, allowed, axes, k: int, structure: str, groups) -> list[np.ndarray]:
    """The chosen elements of each candidate: each group's quota of best elements or slices."""
    chosen: list = [None] * len(allowed)  # masks made as groups are chosen: one bool per element at a time
    for members, quota in groups:
        if not quota:
            continue
        ss, ms = [scores[i] for i in members], [allowed[i] for i in members]
        got = (
            choose_slices(ss, ms, [axes[i] for i in members], quota)
            if structure != "elements"
            else top_k(ss, ms, quota)
        )
        for i, c in zip(members, got):
            chosen[i] = c
    return [np.zeros(m.shape, bool) if c is None else c for c, m in zip(chosen, allowed)]
