"""Plots for reports: PNG files written deterministically (Agg backend, no timestamps).

Every plot function takes a one-line ``caption`` (what to read from the figure) and returns the
report's image entry ``(file name, alt text, caption)``. Colours and markers come from one mapping
(:func:`style_for`): the same policy or predictor looks the same in every figure, in the Okabe-Ito
colour-blind safe palette; heatmaps use viridis (perceptually uniform).

No series may hide another: a series whose points all lie on other series' points (``lfu-incache``
on ``lfru``; a prefetch that changed nothing, on its baseline) is drawn on top with hollow, larger
markers and a dashed line, and one identical to an earlier series says "(same as X)" in the legend.
Reference lines (T, the recorded budget) are legend entries, never text on the data; point labels
(drop-cold's F) are placed where they cover no marker, no line and no other label when such a place
exists. Legends sit outside the axes. Tests read every figure back through :func:`capture`.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator  # noqa: E402

from traces.io.atomic import atomic_write_bytes  # noqa: E402
from traces.util.units import exact  # noqa: E402

plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                     "svg.hashsalt": "moe-replay", "path.simplify": False})

# Okabe & Ito (2008), the colour-blind safe qualitative palette (yellow left out: unreadable on white).
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000")
BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, BLACK = OKABE_ITO
GREY = "#7F7F7F"
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")
HEATMAP_CMAP = "viridis"
# A heatmap's figure size (inches, at 100 dpi) at most: one column of the page at 1400 px (about 630 px
# wide) and its figures' 420 px height, title, labels and colour bar included (bbox "tight" adds ~0.6 in).
HEATMAP_MAX_IN = (5.6, 3.4)

# One (colour, marker) per policy and predictor family, used by every figure. Seven colours cannot
# name sixteen policies apart, so each name also has its own marker; bounds are black and grey.
_STYLE: dict[str, tuple[str, str]] = {
    # cache policies
    "lru": (BLUE, "o"), "lfu": (ORANGE, "s"), "layer": (GREEN, "^"), "lfru": (VERMILLION, "v"),
    "lfu-incache": (SKY, "D"), "layerlfu": (PURPLE, "P"), "layerlfu-incache": (PURPLE, "X"),
    "sieve": (SKY, "<"), "s3fifo": (GREEN, ">"), "random": (GREY, "*"), "pin": (ORANGE, "D"),
    "colibri": (BLUE, "X"), "least-stale": (VERMILLION, "P"), "layer-opt": (GREEN, "s"),
    "belady": (BLACK, ""), "infinite": (GREY, ""),
    # predictors (stale-gate[d] takes its family's style)
    "prev-token": (PURPLE, "o"), "static-hot": (GREEN, "s"), "stale-gate": (VERMILLION, "^"),
    "static-hot-prompt": (SKY, "D"), "ctrl": (BLACK, "x"),
}
BOUNDS_STYLE = {"belady": {"linestyle": "--", "marker": ""}, "infinite": {"linestyle": "--", "marker": ""}}


def family(name: str) -> str:
    """``stale-gate[3]`` -> ``stale-gate``; ``lfu_incache`` -> ``lfu-incache``."""
    return name.split("[", 1)[0].strip().replace("_", "-")


def style_for(name: str) -> dict:
    """The colour and marker of a policy or predictor, the same in every figure; a name the table
    does not know gets a fixed pick from its CRC-32 (still the same in every figure)."""
    f = family(name)
    if f in _STYLE:
        color, marker = _STYLE[f]
    else:
        h = zlib.crc32(f.encode())
        color, marker = OKABE_ITO[h % (len(OKABE_ITO) - 1)], MARKERS[(h // 7) % len(MARKERS)]
    st = {"color": color, "marker": marker}
    st.update(BOUNDS_STYLE.get(f, {}))
    d = name.split("[", 1)[1].rstrip("]") if "[" in name else ""
    if d.isdigit() and int(d) > 1:  # stale-gate[2] beside stale-gate[1]: same family colour, told apart by line and fill
        st.update(linestyle=("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)))[(int(d) - 2) % 4], markerfacecolor="white")
    return st


def color_for(name: str) -> str:
    return style_for(name)["color"]


# -- capture (tests read figures back) and saving --------------------------------------------------

@dataclass
class Captured:
    path: Path
    figure: matplotlib.figure.Figure
    caption: str


_HOOKS: list[Callable[[matplotlib.figure.Figure, Path, str], None]] = []


@contextmanager
def capture(check: Callable[[matplotlib.figure.Figure], None] | None = None) -> Iterator[list[Captured]]:
    """Collect every figure saved inside the block (for tests); ``check(figure)`` runs on each
    before it is saved and closed, while its canvas can still measure text (its exception is raised)."""
    got: list[Captured] = []

    def hook(fig, path, caption):
        got.append(Captured(Path(path), fig, caption))
        if check is not None:
            check(fig)

    _HOOKS.append(hook)
    try:
        yield got
    finally:
        _HOOKS.remove(hook)


def save(fig, path: Path, caption: str = "", alt: str | None = None) -> tuple[str, str, str]:
    """Write a figure as PNG with no varying metadata, so reruns are byte-identical; return the
    report's image entry (file name, alt text, caption)."""
    path = Path(path)
    for hook in list(_HOOKS):
        hook(fig, path, caption)
    if alt is None:
        alt = fig.axes[0].get_title() if fig.axes else path.stem
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path.name, alt, caption


# -- axes helpers ------------------------------------------------------------------------------------

def layer_ticks(ax, n: int, axis: str = "y", labels: list[int] | None = None) -> None:
    """At most ~16 layer labels so 48+ layers never overlap."""
    step = max(1, int(np.ceil(n / 16)))
    pos = list(range(0, n, step))
    lab = [str(labels[i] if labels else i) for i in pos]
    if axis == "y":
        ax.set_yticks(pos, lab)
    else:
        ax.set_xticks(pos, lab)


def budget_label(mib: float) -> str:
    """A budget as a person reads it, exactly: 512 -> '512 MiB', 1024 -> '1 GiB', 1536 -> '1.5 GiB',
    4000 -> '4000 MiB' (3.90625 GiB would be a rounding, so it stays in MiB)."""
    g = mib / 1024
    if mib >= 1024 and abs(g * 100 - round(g * 100)) < 1e-9:
        return f"{exact(float(round(g, 2)))} GiB"
    return f"{exact(float(mib))} MiB"


_NICE_MIB = sorted({m * 10.0 ** p for p in range(-2, 3) for m in (1, 2, 5)} - {500.0} | {1024.0 * 2 ** i for i in range(-1, 21)})


def budget_ticks(lo: float, hi: float, most: int = 7) -> list[float]:
    """Round budgets (1-2-5 MiB below 512 MiB, powers of two from 512 MiB) between ``lo`` and ``hi``;
    the ends themselves when fewer than two round ones fall inside."""
    inside = [t for t in _NICE_MIB if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
    if len(inside) < 2:
        inside = sorted({lo, hi, *inside})
    while len(inside) > most:
        inside = inside[::2]
    return inside


def _budget_ticks_for(data: list[float], lo: float, hi: float) -> list[float]:
    """Round ticks over [lo, hi]; with four budgets or fewer drawn, those budgets themselves, and
    the round ticks not crowding them."""
    ticks = budget_ticks(lo, hi)
    if len(data) <= 4:
        ticks = sorted({*data, *(t for t in ticks if all(abs(math.log(t / d)) > math.log(1.3) for d in data))})
    return ticks


def budget_axis(ax, values: np.ndarray | list[float], axis: str = "x", data: list[float] | None = None) -> None:
    """A log-scaled budget axis over ``values`` with ticks labelled '512 MiB', '1 GiB', '1.5 GiB'
    (no raw floats); ``data``: the budgets drawn (ticked themselves when there are few)."""
    v = np.asarray([x for x in np.asarray(values, dtype=float).ravel() if np.isfinite(x) and x > 0])
    if not v.size:
        return
    ticks = _budget_ticks_for(sorted({float(x) for x in (data or []) if x > 0}), float(v.min()), float(v.max()))
    a = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    a.set_major_locator(FixedLocator(ticks))
    a.set_minor_locator(NullLocator())
    (ax.set_xticklabels if axis == "x" else ax.set_yticklabels)([budget_label(t) for t in ticks])


def _legend(ax, below: bool = False) -> None:
    """Outside the axes (on the right, or below): a legend never covers a curve."""
    h, lab = ax.get_legend_handles_labels()
    if h and below:
        ax.legend(h, lab, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), borderaxespad=0.0, ncol=2)
    elif h:
        ax.legend(h, lab, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _points(x: np.ndarray, y: np.ndarray) -> set[tuple[float, float]]:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    return {(round(float(a), 9), round(float(b), 9)) for a, b in zip(x[ok], y[ok])}


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    xa, ya = (np.asarray(v, dtype=float) for v in a)
    xb, yb = (np.asarray(v, dtype=float) for v in b)
    return xa.shape == xb.shape and ya.shape == yb.shape and bool(
        np.allclose(xa, xb, equal_nan=True, rtol=1e-9, atol=1e-12) and np.allclose(ya, yb, equal_nan=True, rtol=1e-9, atol=1e-12))


def draw_series(ax, series: dict[str, tuple[np.ndarray, np.ndarray]], styles: dict[str, dict] | None = None,
                markers: bool = True, under: frozenset[str] = frozenset()) -> None:
    """Plot every series so each stays visible (see the module docstring); ``under``: series drawn
    as given, beneath the others (a baseline marker that the others start from)."""
    names = list(series)
    pts = {n: _points(*series[n]) for n in names}
    for i, name in enumerate(names):
        x, y = series[name]
        st = {"markersize": 4, "linewidth": 1.5}
        st.update(style_for(name) if markers else {"color": style_for(name)["color"]})
        st.update((styles or {}).get(name, {}))
        label = name
        same = next((m for m in names[:i] if _same(series[m], series[name])), None)
        others = set().union(*(pts[m] for m in names if m != name)) if len(names) > 1 else set()
        covered = bool(pts[name]) and pts[name] <= others and (same is not None or not any(
            _same(series[m], series[name]) for m in names[i + 1:]))
        if len(pts[name]) < 2 and st.get("marker") in (None, "", "none", "None"):
            st["marker"] = "*" if family(name) == "belady" else "d"  # one point: a line alone would draw nothing
            st.setdefault("markersize", 6)
        if same is not None and st.get("linestyle") not in ("none", "None", ""):
            label = f"{name} (same as {same})"  # (a marker overlay, such as 'over budget', marks points, it is no curve)
        if covered and name not in under:
            # On top, hollow and larger, dashed: what lies under it still shows through.
            if st.get("marker") in (None, "", "none", "None"):
                st["marker"] = MARKERS[i % len(MARKERS)]
            st.update(markerfacecolor="none", markersize=float(st.get("markersize", 4)) + 5, markeredgewidth=1.5,
                      zorder=3 + i * 0.01)
            if st.get("linestyle", "-") in ("-", "solid"):
                st["linestyle"] = (0, (4, 3))
        ax.plot(x, y, label=label, **st)


def reference_lines(ax, vlines: dict[str, float] | None) -> None:
    """Vertical reference lines, named in the legend (no text drawn over the curves)."""
    for j, (name, x) in enumerate((vlines or {}).items()):
        ax.axvline(x, color=GREY if j == 0 else "#5A3E8A", linestyle=(":", "-.", (0, (1, 3)))[j % 3], linewidth=1.2,
                   label=name, zorder=1)


def _fix_limits(ax) -> None:
    ax.autoscale_view()
    ax.set_xlim(ax.get_xlim())
    ax.set_ylim(ax.get_ylim())


def place_labels(ax, items: list[tuple[float, float, str, str]], fontsize: float = 7) -> None:
    """Label points ``(x, y, text, colour)`` each where its text covers the fewest markers, line
    pieces and other labels (greedy, in order; deterministic). Points closer than a few pixels are
    labelled once, their texts joined."""
    if not items:
        return
    _fix_limits(ax)
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    trans = ax.transData
    # Obstacles: every drawn line sampled densely along its segments, in display pixels.
    obstacles = []
    for ln in ax.get_lines():
        xy = np.column_stack([np.asarray(ln.get_xdata(), dtype=float), np.asarray(ln.get_ydata(), dtype=float)])
        xy = xy[np.isfinite(xy).all(axis=1)]
        if not len(xy):
            continue
        d = trans.transform(xy)
        obstacles.append(d)
        if ln.get_linestyle() not in ("None", "none", "", " ") and len(d) > 1:
            for a, b in zip(d[:-1], d[1:]):
                n = int(max(2, np.hypot(*(b - a)) // 3))
                obstacles.append(a + (b - a) * np.linspace(0, 1, n)[:, None])
    obs = np.concatenate(obstacles) if obstacles else np.zeros((0, 2))
    # Merge labels of points that coincide on screen.
    merged: list[list] = []
    for x, y, text, color in items:
        p = trans.transform((x, y))
        for m in merged:
            if np.hypot(*(m[0] - p)) < 4 and (m[3] == color or text in m[2]):  # one label for one spot
                if text not in m[2]:
                    m[2].append(text)
                break
        else:
            merged.append([p, (x, y), [text], color])
    axbox = ax.get_window_extent(renderer)
    placed = []
    offsets = [(r * dx, r * dy) for r in (5, 12, 22, 34) for dx, dy in ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0),
                                                                     (0, 1), (0, -1))]
    for _p, (x, y), texts, color in merged:
        best = None
        for dx, dy in offsets:
            t = ax.annotate(", ".join(texts), (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            color=color, ha="left" if dx > 0 else "right" if dx < 0 else "center",
                            va="bottom" if dy > 0 else "top" if dy < 0 else "center", zorder=5,
                            arrowprops={"arrowstyle": "-", "color": color, "linewidth": 0.6, "shrinkA": 0, "shrinkB": 2}
                            if max(abs(dx), abs(dy)) > 5 else None)
            bb = t.get_window_extent(renderer).expanded(1.08, 1.15)
            inside = int(((obs[:, 0] >= bb.x0) & (obs[:, 0] <= bb.x1) & (obs[:, 1] >= bb.y0) & (obs[:, 1] <= bb.y1)).sum())
            # Overlapping another label is worst; leaving the axes (still drawn, outside the data) is next.
            cost = inside + 1000 * sum(bb.overlaps(o) for o in placed) + 100 * (not axbox.contains(bb.x0, bb.y0)
                                                                                 or not axbox.contains(bb.x1, bb.y1))
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, t, bb)
            else:
                t.remove()
            if cost == 0:
                break
        placed.append(best[2])


# -- figures ----------------------------------------------------------------------------------------

def heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, ylabel: str, cbar: str,
            ylabels: list[int] | None = None, xticklabels: list[str] | None = None, vmin=None, vmax=None,
            cmap: str = HEATMAP_CMAP, caption: str = "") -> tuple[str, ...]:
    """A layer x column heatmap, sized to be shown at (about) its natural size in one column of the
    report's page (HEATMAP_MAX_IN): its tick labels then render at their font size (9 pt at 100 dpi,
    12.5 px), not shrunk to ~5 px as a 10-inch figure squeezed into a 420 px box was. The entry
    carries "heatmap" (the page's figure class; tests/test_report_browser.py measures the labels)."""
    h = max(2.6, min(HEATMAP_MAX_IN[1], 0.16 * matrix.shape[0] + 1.5))
    w = HEATMAP_MAX_IN[0] if xticklabels is None else max(4.5, min(HEATMAP_MAX_IN[0], 0.45 * matrix.shape[1] + 2.5))
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
    return (*save(fig, path, caption), "heatmap")


def lines(series: dict[str, tuple[np.ndarray, np.ndarray]], path: Path, title: str, xlabel: str, ylabel: str,
          styles: dict[str, dict] | None = None, vlines: dict[str, float] | None = None, xlog: bool = False,
          ylim: tuple[float, float] | None = None, markers: bool = True, caption: str = "", budget_x: bool = False,
          point_labels: dict[str, list[str]] | None = None) -> tuple[str, str, str]:
    """Line plot. ``budget_x``: the x values are budgets in MiB (log axis, MiB/GiB ticks).
    ``point_labels``: per series, one text per point (placed by :func:`place_labels`)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    draw_series(ax, series, styles, markers)
    reference_lines(ax, vlines)
    if budget_x:
        drawn = np.concatenate([np.asarray(x, dtype=float) for x, _ in series.values()])
        budget_axis(ax, np.concatenate([drawn, np.asarray(list((vlines or {}).values()), dtype=float)]),
                    data=[float(x) for x in drawn if np.isfinite(x)])
    elif xlog:
        ax.set_xscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    items = []
    for name, texts in (point_labels or {}).items():
        x, y = series[name]
        col = next(ln.get_color() for ln in ax.get_lines() if ln.get_label().split(" (same as ")[0] == name)
        items += [(float(a), float(b), t, col) for a, b, t in zip(x, y, texts) if np.isfinite(a) and np.isfinite(b)]
    place_labels(ax, items)
    _legend(ax)
    return save(fig, path, caption)


def bars(labels: list[str], values: list[float], path: Path, title: str, xlabel: str, ylabel: str,
         caption: str = "") -> tuple[str, str, str]:
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    ax.bar(range(len(values)), values, color=BLUE)
    layer_ticks(ax, len(values), "x", [int(x) for x in labels] if all(l.isdigit() for l in labels) else None)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return save(fig, path, caption)


def token_timeline(tokens: np.ndarray, compute: np.ndarray, stall: np.ndarray, other: np.ndarray, lane_read: np.ndarray,
                   path: Path, title: str, caption: str = "") -> tuple[str, str, str]:
    """Per decoded token (the timeline, replay.analyses.timeline): compute, stall and the rest stacked
    (ms), and the read time per lane as a line."""
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(tokens, compute, color=BLUE, label="compute")
    ax.bar(tokens, stall, bottom=compute, color="#d62728", label="stall (waiting for reads)")
    ax.bar(tokens, other, bottom=compute + stall, color="#bbbbbb", label="overhead and serial costs")
    ax.plot(tokens, lane_read, color=BLACK, marker="o", markersize=3, label="read time per lane")
    ax.set_title(title)
    ax.set_xlabel("decoded token")
    ax.set_ylabel("ms")
    _legend(ax)
    return save(fig, path, caption)


def prefetch(rows: list[dict], path: Path, title: str, xlabel: str, ylabel: str, caption: str = "") -> tuple[str, str, str]:
    """Prefetch what-ifs: per row (``predictor``, ``policy`` label, ``x0``/``y0`` without prefetch,
    ``x1``/``y1`` with), a segment from the policy's no-prefetch point (a black marker in the
    policy's shape) to the prefetch point, coloured by predictor, dashed for the second policy."""
    series, styles = {}, {}
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    for pol in pols:
        r = next(r for r in rows if r["policy"] == pol)
        name = f"no prefetch, {pol}"
        series[name] = (np.array([r["x0"]]), np.array([r["y0"]]))
        styles[name] = {"color": BLACK, "marker": style_for(pol.split("+")[0])["marker"] or "s", "markersize": 7,
                        "linestyle": "none", "zorder": 1.5}
    for r in rows:
        j = pols.index(r["policy"])
        name = f"{r['predictor']} / {r['policy']}"
        if (r["x0"], r["y0"]) == (r["x1"], r["y1"]):
            name += " (no change)"
        series[name] = (np.array([r["x0"], r["x1"]]), np.array([r["y0"], r["y1"]]))
        # the marker at the prefetch end only: the start is the policy's black no-prefetch marker
        styles[name] = {**style_for(r["predictor"]), "linestyle": ("-", "--", ":")[j % 3], "markevery": [1]}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    draw_series(ax, series, styles, under=frozenset(n for n in series if n.startswith("no prefetch, ")))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _legend(ax)
    return save(fig, path, caption)


def panels(left: dict[str, tuple[np.ndarray, np.ndarray]], right: dict[str, tuple[np.ndarray, np.ndarray]] | None,
           path: Path, title: str, left_xlabel: str, right_xlabel: str, ylabel: str, left_title: str = "",
           right_title: str = "", left_styles: dict[str, dict] | None = None, right_styles: dict[str, dict] | None = None,
           ylim: tuple[float, float] | None = None, caption: str = "") -> tuple[str, str, str]:
    """Two line panels side by side sharing the y axis (the right one left out when ``right`` is empty)."""
    two = bool(right)
    fig, axes = plt.subplots(1, 2 if two else 1, figsize=(11 if two else 7.5, 4.5), sharey=True, squeeze=False)
    for ax, ser, sty, xl, t in ((axes[0][0], left, left_styles, left_xlabel, left_title),
                                *(((axes[0][1], right, right_styles, right_xlabel, right_title),) if two else ())):
        draw_series(ax, ser, sty)
        ax.set_xlabel(xl)
        ax.set_title(t, fontsize=9)
        if ylim:
            ax.set_ylim(*ylim)
        xs = sorted({float(v) for x, _ in ser.values() for v in np.asarray(x, dtype=float) if np.isfinite(v)})
        if xs and len(xs) <= 12 and all(v.is_integer() for v in xs):
            ax.set_xticks(xs, [exact(v) for v in xs])  # the widths / horizons drawn, not 2.5 steps between them
        _legend(ax, below=True)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    return save(fig, path, caption, alt=title)


# Small multiples are read in the report's two-column grid (.figs: columns of about 637 px at a
# 1400 px window, images at most 420 px high): a figure of SMALL_W x SMALL_H inches at 100 dpi is
# scaled by about 0.8 there, so 9-point tick labels render at about 10 px.
SMALL_W, SMALL_H = 7.8, 5.0
SMALL_MAX_PANELS = 8  # 2 rows of 4: more panels than this and a panel's labels no longer fit


def layer_groups(layers: list[int], most: int = SMALL_MAX_PANELS) -> list[list[int]]:
    """The MoE layers in at most ``most`` runs of consecutive layers whose sizes differ by at most one
    (one per layer when few)."""
    n = len(layers)
    k = min(n, most)
    return [[int(x) for x in g] for g in np.array_split(np.asarray(layers, np.int64), k)] if k else []


def small_multiples(panels: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]], path: Path,
                    title: str, xlabel: str, ylabel: str, ylim: tuple[float, float] = (0, 102),
                    caption: str = "") -> tuple[str, str, str]:
    """One small panel per ``(title, x, y, over, band)``: the line (x, y), shaded grey up to the last x
    where ``over`` is true (needs more memory than it is listed under), and when ``band`` ([2, len(x)]: low, high) is
    given the range it spans, shaded. Panels share both axes; every panel names its axes' units."""
    n = len(panels)
    cols = n if n <= 4 else -(-n // 2)  # one row of up to 4, else two rows as full as they can be
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(SMALL_W, SMALL_H if rows > 1 else SMALL_H * 0.6), sharex=True,
                             sharey=True, squeeze=False)
    for i, ax in enumerate(axes.ravel()):
        if i >= n:
            fig.delaxes(ax)  # no empty panel (and nothing a reader could take for one)
            continue
        name, x, y, over, band = panels[i]
        if band is not None:
            ax.fill_between(x, band[0], band[1], color=BLUE, alpha=0.18, linewidth=0, step=None)
        ax.plot(x, y, color=BLUE, linewidth=1.5)
        if over is not None and over.any():  # over budget: a prefix of the x values (fewer held, more overflow)
            step = float(x[1] - x[0]) if x.shape[0] > 1 else 1.0
            ax.axvspan(float(x[0]) - step / 2, float(x[over].max()) + step / 2, color=GREY, alpha=0.22, linewidth=0,
                       zorder=0)
        ax.set_title(name, fontsize=9, pad=3)
        ax.set_ylim(*ylim)
        ax.set_yticks([0, 50, 100])
        ax.xaxis.set_major_locator(MaxNLocator(3, integer=True))
        ax.tick_params(labelsize=9)
        ax.set_xlabel(xlabel, fontsize=9, labelpad=1)
        if i % cols == 0:
            ax.set_ylabel(ylabel, fontsize=9)
        if i + cols >= n:  # no panel below this one: its own x tick labels (shared axes hide them)
            ax.tick_params(labelbottom=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(pad=0.4, h_pad=0.6, w_pad=0.4)
    return save(fig, path, caption, alt=title)
