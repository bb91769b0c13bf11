"""The report's figures read back through matplotlib's artists (issue #20, item 3): every series
visible (none fully covered by another), axes labelled with units, legends complete, one colour per
policy and predictor across figures, drop points labelled with their exact F, budget ticks in
MiB/GiB, a caption under every figure, PNGs byte-identical across reruns."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.lines import Line2D
from matplotlib.text import Annotation

from replay.present import plots

UNITS = ("%", "MiB", "GiB", "tok/s", "index", "rank", "count", "layers ahead")
FRACS = ["0.25", "0.5", "0.75", "1", "1.5"]


# -- reading a figure back -------------------------------------------------------------------------

def _no(v) -> bool:
    return v is None or (isinstance(v, str) and v.lower() in ("", "none", " "))


def _has_line(ln: Line2D) -> bool:
    return not _no(ln.get_linestyle()) and ln.get_linewidth() > 0


def _has_marker(ln: Line2D) -> bool:
    return not _no(ln.get_marker()) and ln.get_markersize() > 0


def _pts(ln: Line2D) -> list[tuple[float, float]]:
    x, y = np.asarray(ln.get_xdata(), dtype=float), np.asarray(ln.get_ydata(), dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    return [(round(float(a), 9), round(float(b), 9)) for a, b in zip(x[ok], y[ok])]


def _filled(ln: Line2D) -> bool:
    fc = ln.get_markerfacecolor()
    return not (isinstance(fc, str) and fc.lower() == "none") and ln.get_marker() not in ("x", "+", "1", "2", "3", "4", "|", "_")


def covers(top: Line2D, low: Line2D) -> bool:
    """Would ``top``, drawn over ``low``, leave nothing of ``low`` to see?"""
    p_low, p_top = _pts(low), _pts(top)
    if not p_low or not set(p_low) <= set(p_top):
        return False
    if _has_marker(low) and not (_has_marker(top) and top.get_marker() == low.get_marker() and _filled(top)
                                 and top.get_markersize() >= low.get_markersize()):
        return False
    if _has_line(low) and len(set(p_low)) > 1:
        # low's line shows unless top runs the same path, solid and at least as thick
        if not (p_low == p_top and _has_line(top) and top.get_linestyle() in ("-", "solid")
                and top.get_linewidth() >= low.get_linewidth()):
            return False
    return True


def data_lines(ax) -> list[Line2D]:
    return [ln for ln in ax.get_lines() if ln.get_transform() == ax.transData]


def check_series_visible(ax) -> None:
    lines = ax.get_lines()
    order = sorted(range(len(lines)), key=lambda i: (lines[i].get_zorder(), i))  # drawing order
    for n, i in enumerate(order):
        ln = lines[i]
        assert ln.get_visible() and (ln.get_alpha() is None or ln.get_alpha() > 0), ln.get_label()
        assert _has_line(ln) or _has_marker(ln), f"{ln.get_label()}: neither a line nor markers"
        if ln in data_lines(ax) and len(set(_pts(ln))) < 2:
            assert _has_marker(ln), f"{ln.get_label()}: a single point drawn as a line alone shows nothing"
        if ln in data_lines(ax):
            x0, x1 = sorted(ax.get_xlim())
            y0, y1 = sorted(ax.get_ylim())
            assert any(x0 <= a <= x1 and y0 <= b <= y1 for a, b in _pts(ln)), f"{ln.get_label()}: no point inside the axes"
            for j in order[n + 1:]:
                assert not covers(lines[j], ln), f"{ln.get_label()!r} is hidden under {lines[j].get_label()!r}"


def check_legend(ax, fig) -> None:
    labelled = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    if not labelled:
        return
    leg = ax.get_legend()
    assert leg is not None, f"{ax.get_title()}: labelled series but no legend"
    texts = [t.get_text() for t in leg.get_texts()]
    assert texts == [ln.get_label() for ln in labelled]  # every series named, nothing else
    looks = {}
    for h, t in zip(leg.legend_handles, texts):
        assert isinstance(h, Line2D) and (_has_line(h) or _has_marker(h)), f"legend entry {t!r} shows nothing"
        assert h.get_alpha() is None or h.get_alpha() > 0
        look = (to_hex(h.get_color()), h.get_marker() if _has_marker(h) else None, str(h.get_linestyle()) if _has_line(h) else None,
                str(h.get_markerfacecolor()))
        assert look not in looks, f"legend entries {looks.get(look)!r} and {t!r} look the same"
        looks[look] = t
    # the legend sits outside the data area: it covers no curve
    r = fig.canvas.get_renderer()
    lb, axb = leg.get_window_extent(r), ax.get_window_extent(r)
    assert not lb.overlaps(axb) or lb.x0 >= axb.x1 - 1 or lb.y1 <= axb.y0 + 1


def check_units(label: str, what: str) -> None:
    groups = re.findall(r"\(([^()]*)\)", label)
    assert any(u in g for g in groups for u in UNITS), f"{what} {label!r} names no unit in parentheses"


def check_texts(ax, fig) -> None:
    """Text on the data area is only point labels, each near its point, over no marker and no other label."""
    r = fig.canvas.get_renderer()
    boxes = []
    marks = np.array([ax.transData.transform(p) for ln in data_lines(ax) if _has_marker(ln) for p in _pts(ln)] or
                     np.zeros((0, 2)))
    for t in ax.texts:
        assert isinstance(t, Annotation) and t.xycoords == "data", f"free text {t.get_text()!r} on the data area"
        bb = t.get_window_extent(r)
        inside = [(x, y) for x, y in marks if bb.x0 < x < bb.x1 and bb.y0 < y < bb.y1]
        assert not inside, f"label {t.get_text()!r} covers a marker"
        assert not any(bb.overlaps(o) for o in boxes), f"label {t.get_text()!r} overlaps another"
        boxes.append(bb)


def check_figure(fig) -> None:
    main = [ax for ax in fig.axes if not hasattr(ax, "_colorbar")]
    for ax in fig.axes:
        if hasattr(ax, "_colorbar"):
            check_units(ax.get_ylabel(), "colour bar")
            continue
        check_units(ax.get_xlabel(), f"{ax.get_title()!r} x axis")
        if ax is main[0] or ax.get_ylabel():
            check_units(ax.get_ylabel(), f"{ax.get_title()!r} y axis")
        check_series_visible(ax)
        check_legend(ax, fig)
        check_texts(ax, fig)
        for im in ax.get_images():
            assert im.get_cmap().name in ("viridis", "cividis", "magma", "inferno", "plasma")


def label_colours(figs) -> dict[str, set[str]]:
    """Policy/predictor name -> every colour it was drawn in, over all figures."""
    seen: dict[str, set[str]] = {}
    for c in figs:
        for ax in c.figure.axes:
            for ln in ax.get_lines():
                lab = ln.get_label().split(" (")[0]
                name = lab.split(" / ")[0].split(",")[0].strip()
                if plots.family(name) in plots._STYLE:
                    seen.setdefault(plots.family(name), set()).add(to_hex(ln.get_color()))
    return seen


# -- the report's figures --------------------------------------------------------------------------

def _report_checked(trace, out, **kw) -> tuple[list, list[str]]:
    """Write the report of ``trace`` with every figure read back by check_figure before it is saved:
    (the captured figures, one line per failed check)."""
    from replay.analyses.report import write_report

    failures: list[str] = []

    def check(fig):
        try:
            check_figure(fig)
        except AssertionError as e:
            failures.append(f"{fig.axes[0].get_title()}: {e}")

    with plots.capture(check) as got:
        write_report(trace, out, **kw)
    return got, failures


@pytest.fixture(scope="module")
def synth_report(synth_trace_dir, tmp_path_factory):
    """The whole report on a small synthetic trace, lfu-incache and lfru both asked for (their
    curves coincide there), with a manual cost model so time plots are drawn."""
    from replay.analyses.cost_model import manual_model

    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    out = tmp_path_factory.mktemp("plots") / "r"
    figs, failures = _report_checked(d, out, policies=["lru", "lfu", "lfu-incache", "lfru", "layer"],
                                     cost_model=manual_model(2000.0, 20.0))
    return {c.path.name: c for c in figs}, out, failures


EXPECTED = {"cache_lru_curve.png", "cache_layer_curves.png",
            "cache_curves.png", "cache_tok_s.png", "cache_per_layer.png", "popularity.png", "concentration.png",
            "drop_tradeoff.png", "prefetch.png", "predict_per_layer.png", "predict_accuracy.png"}


def test_every_report_figure_reads_back(synth_report):
    """check_figure ran on each figure before it was closed (while its canvas could measure text)."""
    figs, out, failures = synth_report
    assert EXPECTED <= set(figs)
    assert not failures, failures
    for name in figs:
        assert (out / name).is_file()


def test_coinciding_policies_are_both_visible_and_named(synth_report):
    figs, _, _ = synth_report
    for png in ("cache_curves.png", "cache_tok_s.png"):
        labels = [ln.get_label() for ln in figs[png].figure.axes[0].get_lines()]
        assert "lfru (same as lfu-incache)" in labels, labels  # they coincide on this trace
        assert "lfu-incache" in labels


def test_colours_are_one_per_policy_and_predictor_across_figures(synth_report):
    figs, _, _ = synth_report
    seen = label_colours(figs.values())
    assert {"lru", "lfu", "lfru", "prev-token", "static-hot"} <= set(seen)
    for name, colours in seen.items():
        assert colours == {to_hex(plots.color_for(name))}, (name, colours)
    assert len({plots.color_for(p) for p in ("lru", "lfu", "layer", "lfru", "lfu-incache", "belady")}) == 6


def test_drop_points_carry_their_exact_f(synth_report):
    figs, _, _ = synth_report
    ax = figs["drop_tradeoff.png"].figure.axes[0]
    got = [f.strip() for t in ax.texts for f in t.get_text().split(",")]
    assert sorted(got) == sorted(f"F={f}" for f in FRACS), got  # one drop-cold series here (closed loop)
    assert "F=0.2" not in got and "F=0.8" not in got


def test_budget_ticks_read_in_mib_and_gib(synth_report):
    figs, _, _ = synth_report
    for png in ("cache_curves.png", "cache_tok_s.png"):
        ticks = [t.get_text() for t in figs[png].figure.axes[0].get_xticklabels() if t.get_text()]
        assert ticks and all(re.fullmatch(r"\d+(\.\d+)? (MiB|GiB)", t) for t in ticks), ticks
    assert "tok/s" in figs["cache_tok_s.png"].figure.axes[0].get_ylabel()
    heat = [t.get_text() for t in figs["cache_per_layer.png"].figure.axes[0].get_xticklabels()]
    assert all(re.fullmatch(r"\d+(\.\d+)? (MiB|GiB)", t) for t in heat), heat


def test_predictor_accuracy_against_width_and_horizon(synth_report):
    figs, _, _ = synth_report
    fig = figs["predict_accuracy.png"].figure
    by_width, by_horizon = [ax for ax in fig.axes]
    assert "width" in by_width.get_xlabel() and "horizon" in by_horizon.get_xlabel()
    assert [ln.get_label() for ln in by_horizon.get_lines()] == ["stale-gate, 2 named", "stale-gate, 4 named",
                                                                  "stale-gate, 8 named"]
    for ln in by_width.get_lines():
        assert list(ln.get_xdata()) == [2, 4, 8]
        y = np.asarray(ln.get_ydata(), dtype=float)
        assert np.all(np.diff(y[np.isfinite(y)]) >= -1e-9), ln.get_label()  # naming more never covers less


def test_captions_are_printed_under_every_figure(synth_report):
    figs, out, _ = synth_report
    md = (out / "index.md").read_text()
    html = (out / "index.html").read_text()
    for name, c in figs.items():
        assert c.caption and "\n" not in c.caption, name
        assert f"]({name})\n\n*{c.caption}*\n" in md, name
    assert html.count("<figcaption>") == len(figs)


# -- the failure modes, drawn directly -------------------------------------------------------------

def _one(tmp_path, fn, *args, **kw):
    """Draw one figure; check_figure reads it back before it is closed."""
    with plots.capture(check_figure) as got:
        fn(*args, **kw)
    assert len(got) == 1
    return got[0].figure


def test_identical_series_are_not_drawn_over_each_other(tmp_path):
    """lfu under lfru: the same data twice must stay visible twice (it was drawn identically, on top)."""
    x, y = np.array([100.0, 200.0, 400.0]), np.array([10.0, 40.0, 70.0])
    fig = _one(tmp_path, plots.lines, {"lfru": (x, y), "lfu": (x, y.copy()), "lru": (x, y + 5)}, tmp_path / "a.png", "t",
               "cache budget (MiB)", "hit rate (%)", caption="c")
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels == ["lfru", "lfu (same as lfru)", "lru"]


def test_a_prefetch_that_changed_nothing_stays_visible(tmp_path):
    """The prefetch plot had a legend entry whose segment (no change, a single point) lay under
    another row's baseline marker."""
    rows = [{"predictor": "prev-token", "policy": "lru", "x0": 156.0, "y0": 80.3, "x1": 156.0, "y1": 80.3},
            {"predictor": "prev-token", "policy": "lfru+guard", "x0": 203.0, "y0": 74.2, "x1": 217.0, "y1": 74.9},
            {"predictor": "static-hot", "policy": "lru", "x0": 156.0, "y0": 80.3, "x1": 160.0, "y1": 81.2},
            {"predictor": "static-hot", "policy": "lfru+guard", "x0": 203.0, "y0": 74.2, "x1": 223.0, "y1": 74.8}]
    fig = _one(tmp_path, plots.prefetch, rows, tmp_path / "p.png", "t", "reads (MiB/token)", "hit rate (%)", caption="c")
    assert "prev-token / lru (no change)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_reference_lines_are_legend_entries_not_text_on_the_curves(tmp_path):
    x = np.array([100.0, 1000.0, 4096.0])
    fig = _one(tmp_path, plots.lines, {"belady": (x, np.array([90.0, 99.0, 100.0]))}, tmp_path / "v.png", "t",
               "cache budget (MiB/GiB, log scale)", "hit rate (%)", vlines={"T = one token cycle (92 MiB)": 92.0,
                                                                            "recorded budget (4 GiB)": 4096.0},
               budget_x=True, caption="c")
    ax = fig.axes[0]
    assert not ax.texts
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["belady", "T = one token cycle (92 MiB)",
                                                                   "recorded budget (4 GiB)"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["100 MiB", "200 MiB", "512 MiB", "1000 MiB", "2 GiB", "4 GiB"]


def test_point_labels_avoid_markers_and_each_other(tmp_path):
    """Crowded points: labels still cover no marker and no other label (merged where points coincide)."""
    x = np.array([0.0, 0.1, 5.0, 5.2, 60.0])
    fig = _one(tmp_path, plots.lines, {"a": (x, x / 10), "b": (x + 0.05, x / 10 + 0.05)}, tmp_path / "l.png", "t",
               "reads avoided (%)", "mass (%)", point_labels={"a": [f"F={f}" for f in FRACS]}, caption="c")
    got = [f.strip() for t in fig.axes[0].texts for f in t.get_text().split(",")]
    assert sorted(got) == sorted(f"F={f}" for f in FRACS)


def test_budget_labels_are_exact():
    assert [plots.budget_label(b) for b in (512.0, 1024.0, 1536.0, 4000.0, 390.5, 2560.0, 3.0 * 1024)] == [
        "512 MiB", "1 GiB", "1.5 GiB", "4000 MiB", "390.5 MiB", "2.5 GiB", "3 GiB"]


def test_saved_png_is_byte_identical(tmp_path):
    x = np.array([0.0, 0.1, 5.0, 5.2, 60.0])
    for n in ("a", "b"):
        plots.lines({"a": (x, x / 10), "lfru": (x, x), "lfu": (x, x)}, tmp_path / f"{n}.png", "t", "x (%)", "y (%)",
                    point_labels={"a": FRACS}, caption="c")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_unknown_names_get_a_fixed_style():
    a, b = plots.style_for("my-policy"), plots.style_for("my-policy")
    assert a == b and a["color"] in plots.OKABE_ITO
    g1, g3 = plots.style_for("stale-gate[1]"), plots.style_for("stale-gate[3]")
    assert g1 == plots.style_for("stale-gate") and (g3["color"], g3["marker"]) == (g1["color"], g1["marker"]) and g3 != g1
    assert Path(plots.__file__).name == "plots.py"


def test_real_qwen_report_figures_read_back(real_trace_dir, tmp_path):
    """The Qwen phone trace: recorded budget (4000 MiB) and T as legend entries, a fitted cost model
    (so tok/s against budget), every figure passing the same read-back checks."""

    got, failures = _report_checked(real_trace_dir("qwen"), tmp_path / "r")
    figs = {c.path.name: c for c in got}
    assert not failures, failures
    assert EXPECTED <= set(figs)
    legend = [t.get_text() for t in figs["cache_curves.png"].figure.axes[0].get_legend().get_texts()]
    assert "recorded budget (4000 MiB)" in legend and any(t.startswith("T = one token cycle (") for t in legend)
    assert "prev-token / lru (no change)" in [t.get_text() for t in figs["prefetch.png"].figure.axes[0].get_legend().get_texts()]
    drop = [f.strip() for t in figs["drop_tradeoff.png"].figure.axes[0].texts for f in t.get_text().split(",")]
    assert set(drop) == {f"F={f}" for f in FRACS}  # static and closed loop; coinciding labels shared


def test_images_without_a_caption_still_render():
    """Section.images entries may stay (file, alt): no caption line, a plain <p><img>."""
    from replay.present.report import Section, render_markdown

    md = render_markdown("t", [Section("s", images=[("a.png", "alt")]), Section("u", images=[("b.png", "alt", "read *this*")])])
    assert "![alt](a.png)\n\n## u" in md and "![alt](b.png)\n\n*read \\*this\\**\n" in md


# The report's .figs grid at a 1400 px window (replay/present/report.py's CSS): body at most 1320 px
# less 2 x 15 px padding, two columns 16 px apart; images at most 420 px high.
FIG_COLUMN_PX, FIG_MAX_H_PX = (1320 - 30 - 16) / 2, 420


def rendered_px(fig, png: Path) -> dict[str, float]:
    """Each tick label, axis label and title of ``fig`` in px as the report shows the saved ``png``
    at 1400 px (the image scaled to its column), keyed by what it is."""
    from PIL import Image

    w, h = Image.open(png).size
    scale = min(1.0, FIG_COLUMN_PX / w, FIG_MAX_H_PX / h)
    px = fig.dpi / 72 * scale
    out = {}
    for i, ax in enumerate(a for a in fig.axes if a.get_visible()):
        texts = [*ax.get_xticklabels(), *ax.get_yticklabels(), ax.xaxis.label, ax.yaxis.label, ax.title]
        for t in texts:
            if t.get_visible() and t.get_text():
                out[f"panel {i}: {t.get_text()}"] = t.get_fontsize() * px
    return out


@pytest.mark.parametrize("n_layers", [3, 6, 48])
def test_layer_curves_are_small_multiples_readable_at_1400_px(tmp_path, n_layers):
    """issue 32: the per-layer curves as small multiples, one panel per layer or per run of layers
    when there are many, every label at least 9 px as the report shows the figure at 1400 px."""
    layers = list(range(0, 2 * n_layers, 2))
    groups = plots.layer_groups(layers)
    assert [x for g in groups for x in g] == layers and len(groups) == min(n_layers, plots.SMALL_MAX_PANELS)
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    n = 16
    x = np.arange(1, n + 1, dtype=float)
    panels = [(f"layers {g[0]}-{g[-1]}", x, np.linspace(0, 100, n) ** (1 + i / 10) / 100 ** (i / 10), x < 3,
               np.stack([np.zeros(n), np.full(n, 100.0)])) for i, g in enumerate(groups)]
    with plots.capture(check_figure) as got:
        plots.small_multiples(panels, tmp_path / "f.png", "LRU hit rate per MoE layer (decode-only), exact",
                              "experts held (count)", "decode-only hit (%)")
    fig = got[0].figure
    assert sum(ax.get_visible() for ax in fig.axes) == len(groups)
    sizes = rendered_px(fig, tmp_path / "f.png")
    small = {k: round(v, 1) for k, v in sizes.items() if v < 9}
    assert sizes and not small, small


def test_the_layer_curves_figure_draws_each_layers_exact_curve(synth_report, synth_trace_dir):
    import replay

    figs, _, _ = synth_report
    c = figs["cache_layer_curves.png"]
    d = synth_trace_dir(layers=6, experts=16, top_k=2, embd=8, tokens=40, prompt_tokens=8)
    per = replay.curve_run(d, policies=["layer"]).per_layer
    layers = sorted(per["layer"].unique().to_list())
    axes = [ax for ax in c.figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == [f"layer {x}" for x in layers]
    assert f"one panel per layer ({len(layers)})" in c.caption
    for ax, layer in zip(axes, layers):
        want = per.filter((per["layer"] == layer) & (per["entries"] > 0)).sort("entries")["hit_pct_decode"].to_numpy()
        assert np.array_equal(ax.get_lines()[0].get_ydata(), want)
