"""``Freezer.plot``: one picture of what is frozen."""

from __future__ import annotations

import os

import numpy as np

from finefreeze._report.maskview import FROZEN_RGB, TRAINED_RGB, as_matrix, frozen_fraction_image, to_rgb

__all__ = ["plot"]

_MAX_ROWS = 40
_MAX_MASKS = 4


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "Freezer.plot needs matplotlib: pip install 'finefreeze[plot]' (or pip install matplotlib)."
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _rows(rep):
    """Bars per variable, or per layer when there are too many variables."""
    items = rep["variables"] if len(rep["variables"]) <= _MAX_ROWS else rep["layers"]
    key = "path" if items is rep["variables"] else "layer"
    rows = []
    for it in items:
        keras_trains = it["trainable_elements"] + it["frozen_elements"]
        if keras_trains == 0:
            continue  # moving statistics: not trained by Keras at all
        rows.append((it[key] or "(root)", it["trainable_elements"], it["frozen_elements"]))
    if len(rows) > _MAX_ROWS:  # still too many: keep partial rows and the largest others
        rows.sort(key=lambda r: (not (r[1] and r[2]), -(r[1] + r[2])))
        rows = rows[:_MAX_ROWS]
    return rows


def _bars(ax, rows, orange, blue) -> None:
    """One bar per row: its trained share in orange, its frozen share in blue, with counts."""
    from matplotlib.patches import Patch

    names = [r[0] for r in rows]
    total = np.array([max(1, r[1] + r[2]) for r in rows], dtype=float)
    trained = np.array([r[1] for r in rows], dtype=float) / total
    y = np.arange(len(rows))
    ax.barh(y, trained, color=orange, height=0.7)
    ax.barh(y, 1 - trained, left=trained, color=blue, height=0.7)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of elements (orange: trained, blue: frozen)")
    for yi, (_, t, f) in zip(y, rows):
        label = f"{t:,} of {t + f:,} trained" if t and f else (f"trained ({t:,})" if t else f"frozen ({f:,})")
        ax.text(0.99, yi, label, va="center", ha="right", fontsize=7, color="white")
    ax.legend(
        handles=[Patch(color=orange, label="trained"), Patch(color=blue, label="frozen")],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )


def _mask(mx, s) -> None:
    """The frozen mask of a partially frozen variable as an image (a matrix view of it)."""
    from matplotlib.ticker import MaxNLocator

    matrix = as_matrix(s.frozen_mask())
    img = frozen_fraction_image(matrix, max_side=400)
    h, w = matrix.shape
    mx.imshow(to_rgb(img), aspect="auto", interpolation="nearest", extent=(-0.5, w - 0.5, h - 0.5, -0.5))
    mx.set_xlabel("column", fontsize=7)
    mx.set_ylabel("row", fontsize=7)
    shape = "x".join(str(d) for d in s.info.shape)
    view = "" if len(s.info.shape) == 2 else " (reshaped)"
    mx.set_title(f"{s.path} [{shape}]{view}: {s.n_trainable:,} trained", fontsize=8)
    mx.tick_params(labelsize=7)
    mx.xaxis.set_major_locator(MaxNLocator(integer=True))
    mx.yaxis.set_major_locator(MaxNLocator(integer=True))


def plot(frz, path: str | os.PathLike, *, title: str | None = None, dpi: int = 120) -> str:
    """Draw ``frz``'s plan to an image file; return the path."""
    plt = _pyplot()
    rep = frz.report()
    rows = _rows(rep)
    partial = [s for s in frz._res.states if s.state == "partial"][:_MAX_MASKS]
    blue = tuple(c / 255 for c in FROZEN_RGB)
    orange = tuple(c / 255 for c in TRAINED_RGB)

    height = max(3.0, 0.28 * len(rows) + 1.6)
    ncols = 2 if partial else 1
    fig = plt.figure(figsize=(13 if partial else 9, height), dpi=dpi)
    grid = fig.add_gridspec(max(1, len(partial)), ncols, width_ratios=[1.5, 1] if partial else [1])
    _bars(fig.add_subplot(grid[:, 0]), rows, orange, blue)
    t = rep["totals"]
    keras_trains = max(1, t["elements"] - t["untrained_elements"])
    fig.suptitle(
        title
        or f"{t['trainable_elements']:,} trained / {t['frozen_elements']:,} frozen elements "
        f"({100 * t['trainable_elements'] / keras_trains:.2f}% trained)",
        fontsize=11,
    )
    for i, s in enumerate(partial):
        _mask(fig.add_subplot(grid[i, 1]), s)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path)
    plt.close(fig)
    return path
