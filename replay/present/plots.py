"""Plots for reports: PNG files written deterministically (Agg backend, no timestamps)."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from traces.atomic import atomic_write_bytes  # noqa: E402

plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                     "svg.hashsalt": "moe-replay", "path.simplify": False})


def save(fig, path: Path) -> Path:
    """Write a figure as PNG with no varying metadata, so reruns are byte-identical."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def layer_ticks(ax, n: int, axis: str = "y", labels: list[int] | None = None) -> None:
    """At most ~16 layer labels so 48+ layers never overlap."""
    step = max(1, int(np.ceil(n / 16)))
    pos = list(range(0, n, step))
    lab = [str(labels[i] if labels else i) for i in pos]
    if axis == "y":
        ax.set_yticks(pos, lab)
    else:
        ax.set_xticks(pos, lab)


def heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, ylabel: str, cbar: str,
            ylabels: list[int] | None = None, xticklabels: list[str] | None = None, vmin=None, vmax=None,
            cmap: str = "viridis") -> Path:
    h = max(3.0, min(10.0, 0.16 * matrix.shape[0] + 1.5))
    w = 7.5 if xticklabels is None else max(5.0, min(10.0, 0.9 * matrix.shape[1] + 2.5))
    fig, ax = plt.subplots(figsize=(w, h))
    im = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax)
    ax.grid(False)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    layer_ticks(ax, matrix.shape[0], "y", ylabels)
    if xticklabels is not None:
        ax.set_xticks(range(len(xticklabels)), xticklabels, rotation=45, ha="right")
    fig.colorbar(im, ax=ax, label=cbar)
    return save(fig, path)


def lines(series: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str, xlabel: str, ylabel: str,
          styles: dict[str, dict] | None = None, vlines: dict[str, float] | None = None, xlog: bool = False,
          ylim: tuple[float, float] | None = None, markers: bool = True) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, (x, y) in series.items():
        st = {"marker": "o", "markersize": 3} if markers else {}
        st.update((styles or {}).get(name, {}))
        ax.plot(x, y, label=name, **st)
    for name, x in (vlines or {}).items():
        ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.annotate(name, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=8, color="grey")
    if xlog:
        ax.set_xscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="best")
    return save(fig, path)


def bars(labels: list[str], values: list[float], path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    ax.bar(range(len(values)), values)
    layer_ticks(ax, len(values), "x", [int(x) for x in labels] if all(l.isdigit() for l in labels) else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return save(fig, path)
