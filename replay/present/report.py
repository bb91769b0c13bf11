"""The report rendered: a verdict first, a table of contents, then its sections (text, tables,
images) as Markdown and as one self-contained HTML file. Pure: sections in, text out (the images are
read from the report directory to embed).

Rendered tables carry human headers with units (``HEADERS``; the CSVs keep the docs/design.md keys),
text left-aligned and numbers right-aligned. A long table (per layer, per layer x budget) is shown
as a compact summary; the table itself is a collapsed ``<details>`` block in the HTML and a link to
its CSV in the Markdown. Sections the trace cannot support are not rendered as sections: they are
listed on one line under the table of contents, with what is missing and how to get it.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from replay.present.format import HEADERS, cell


@dataclass
class Table:
    name: str  # CSV file stem
    frame: pl.DataFrame
    caption: str
    columns: list[str] | None = None  # shown in md/html (CSV holds all)
    digits: int | dict[str, int] | None = None  # None: each column at its quantity's precision (replay.present.format.PRECISION)
    headers: dict[str, str] | None = None  # md/html header of a column, where HEADERS' name is not the right one
    collapsed: bool = False  # long: a <details> block in the HTML, a link to the CSV in the Markdown
    marks: dict[str, list[bool]] | None = None  # column -> per-row flag: the cell is printed with a trailing "!"
    # column -> per-row text after the cell (the cost model's marks: ^ extrapolated, ~ foreign); by
    # default (None) derived from the rows' own ``extrapolated`` / ``cost_model_foreign`` columns
    time_marks: dict[str, list[str]] | None = None


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    # (file, alt text) or (file, alt text, caption): the caption, one line saying what to read from the
    # figure, is printed under it (an italic line in Markdown, a <figcaption> in HTML).
    images: list[tuple[str, ...]] = field(default_factory=list)
    unavailable: str | None = None
    code: str | None = None
    notes: list[str] = field(default_factory=list)  # definitions and caveats: after the text (collapsed in the HTML)
    missing: list[tuple[str, str]] = field(default_factory=list)  # parts left out: (what, why and how to get it)

    @property
    def anchor(self) -> str:
        return anchor(self.title)


def anchor(title: str) -> str:
    """The heading's anchor as GitHub makes it (lower case, punctuation dropped, spaces to '-'),
    and the id the HTML gives the same heading: one link works in both."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


# Human headers with units (replay.present.format.HEADERS: the same header for the same quantity in every
# text table and the report); a key not there is shown as it is (a predictor's or policy's name).


def header(t: Table, c: str) -> str:
    return (t.headers or {}).get(c) or HEADERS.get(c, c)


def _numeric(t: Table, c: str) -> bool:
    return t.frame.schema[c].is_numeric()


def md_cell(text: str) -> str:
    """A Markdown table cell: a ``|`` would end the cell (escaped), a newline the row (a space)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _cells(t: Table) -> list[list[str]]:
    cols = t.columns or t.frame.columns
    marks = t.marks if t.marks is not None else over_budget_marks(t.frame)
    tm = t.time_marks if t.time_marks is not None else row_time_marks(t.frame)
    out = []
    for i, r in enumerate(t.frame.select(cols).rows()):
        out.append([cell(c, v, t.digits) + ("!" if marks.get(c) and marks[c][i] else "") + (tm[c][i] if c in tm else "")
                    for c, v in zip(cols, r)])
    return out


# Columns that hold a time figure from the cost model, and (for those with one) the column that says
# whether that figure was extrapolated.
TIME_COLUMNS = {"ms_per_token": "extrapolated", "tok_s": "extrapolated", "ms_per_token_ci95": "extrapolated",
                "ms_per_token_baseline": "extrapolated_baseline", "tok_s_baseline": "extrapolated_baseline",
                "ms_saved_per_token": None}


def row_time_marks(frame: pl.DataFrame) -> dict[str, list[str]]:
    """Per time column, per row: "^" where the row's figure is extrapolated beyond the fitted read
    volumes, "~" where the model is foreign (docs/design.md, "Cost model")."""
    from replay.present.cost import EXTRAPOLATED, FOREIGN

    out: dict[str, list[str]] = {}
    foreign = (frame["cost_model_foreign"].fill_null(False).to_list() if "cost_model_foreign" in frame.columns
               else [False] * frame.height)
    for c, flag in TIME_COLUMNS.items():
        if c not in frame.columns:
            continue
        ext = frame[flag].fill_null(False).to_list() if flag and flag in frame.columns else [False] * frame.height
        marks = [(EXTRAPOLATED if e else "") + (FOREIGN if f else "") for e, f in zip(ext, foreign)]
        if any(marks):
            out[c] = marks
    return out


def over_budget_marks(frame: pl.DataFrame) -> dict[str, list[bool]]:
    """A table of cache rows marks the hit % of a row whose cache overflowed its budget (``overflow_loads``
    > 0: that hit rate needs more memory than the budget), as the cache tables do."""
    if "overflow_loads" not in frame.columns:
        return {}
    over = [bool(v) for v in frame["overflow_loads"].fill_null(0).to_list()]
    return {c: over for c in frame.columns if c.startswith("hit_pct")} if any(over) else {}


def _md_table(t: Table) -> str:
    cols = t.columns or t.frame.columns
    out = ["| " + " | ".join(md_cell(header(t, c)) for c in cols) + " |",
           "|" + "|".join("---:" if _numeric(t, c) else ":---" for c in cols) + "|"]
    out += ["| " + " | ".join(md_cell(v) for v in row) + " |" for row in _cells(t)]
    return "\n".join(out)


def _html_table(t: Table) -> str:
    cols = t.columns or t.frame.columns
    cls = ["n" if _numeric(t, c) else "t" for c in cols]
    head = "".join(f"<th class='{k}'>{html.escape(header(t, c))}</th>" for c, k in zip(cols, cls))
    # numbers and short text stay on one line; long text (a description, a list) wraps
    body = "".join("<tr>" + "".join(f"<td class='{k}{' w' if k == 't' and len(v) > 24 else ''}'>{html.escape(v)}</td>"
                                    for v, k in zip(row, cls)) + "</tr>" for row in _cells(t))
    return f"<table><caption>{html.escape(t.caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_markdown(title: str, sections: list[Section], verdict: list[str] | None = None) -> str:
    """``verdict``: the answer-first lines, already Markdown (links to the sections' anchors)."""
    shown = [s for s in sections if not s.unavailable]
    out = [f"# {title}", ""]
    if verdict:
        out += ["## Verdict", ""] + [f"- {v}" for v in verdict] + [""]
    out += ["**Contents:** " + " · ".join(f"[{s.title}](#{s.anchor})" for s in shown), ""]
    missing = not_available(sections)
    if missing:
        out += [f"*{missing}*", ""]
    for s in shown:
        out += [f"## {s.title}", ""]
        if s.code:
            out += ["```", s.code, "```", ""]
        for p in s.text + s.notes:
            out += [p, ""]
        for img, alt, *cap in s.images:
            out += [f"![{alt}]({img})", ""] + ([f"*{md_cell(cap[0]).replace('*', chr(92) + '*')}*", ""] if cap and cap[0] else [])
        for t in s.tables:
            if t.collapsed:
                out += [f"**{t.caption}**: {t.frame.height} rows in [CSV](tables/{t.name}.csv).", ""]
            else:
                out += [f"**{t.caption}** ([CSV](tables/{t.name}.csv))", "", _md_table(t), ""]
    return "\n".join(out)


def not_available(sections: list[Section]) -> str | None:
    """One line: the sections (and parts of sections) this trace cannot support, why, and how to get them."""
    why: dict[str, list[str]] = {}  # reason -> what it keeps out, in order (a reason shared by parts is said once)
    for s in sections:
        for what, reason in ([(f"the {s.title.lower()} section", s.unavailable)] if s.unavailable else s.missing):
            why.setdefault(reason, []).append(what)
    items = [f"{', '.join(whats)}: {reason}" for reason, whats in why.items()]
    return ("Not in this report: " + "; ".join(items) + ".") if items else None


CSS = ("body{font-family:system-ui,sans-serif;max-width:1320px;margin:1em auto;padding:0 1em;color:#222;line-height:1.35;font-size:15px}"
       "h1{font-size:1.5em;margin:.4em 0}h2{margin:1.2em 0 .4em}"
       "table{border-collapse:collapse;margin:.6em 0;font-size:13px;max-width:100%}"
       "td,th{border:1px solid #ccc;padding:3px 7px;vertical-align:top}"
       "th{background:#f3f3f3;font-weight:600;max-width:12em}.n{text-align:right}.t{text-align:left}"
       "td{white-space:nowrap}td.w{white-space:normal;min-width:14em}"
       "caption{text-align:left;font-weight:600;margin-bottom:4px}"
       ".figs{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:8px 16px;align-items:start}"
       ".figs p:first-child{margin-top:0}"
       ".figs img{max-width:100%;max-height:420px;height:auto}"
       "figure{margin:0}figcaption{font-style:italic;font-size:90%;color:#444;margin-top:2px}"
       "pre{background:#f5f5f5;padding:8px;overflow-x:auto;white-space:pre-wrap;font-size:12px}"
       ".na{color:#a33;font-style:italic}.verdict{background:#f6f9ff;border:1px solid #c9d7f0;padding:.2em 1em .6em}"
       ".verdict li{margin:.25em 0}nav{margin:.6em 0}details{margin:.4em 0}summary{cursor:pointer}")


def _html_text(md: str) -> str:
    """A verdict line's Markdown (bold, links to anchors, inline code) as HTML."""
    out = html.escape(md, quote=False)
    out = re.sub(r"\[([^\]]+)\]\(#([a-z0-9_-]+)\)", r"<a href='#\2'>\1</a>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def render_html(title: str, sections: list[Section], out: Path, verdict: list[str] | None = None) -> str:
    shown = [s for s in sections if not s.unavailable]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if verdict:
        parts.append("<section class='verdict'><h2 id='verdict'>Verdict</h2><ul>"
                     + "".join(f"<li>{_html_text(v)}</li>" for v in verdict) + "</ul></section>")
    parts.append("<nav><b>Contents:</b> " + " · ".join(f"<a href='#{s.anchor}'>{html.escape(s.title)}</a>" for s in shown)
                 + "</nav>")
    missing = not_available(sections)
    if missing:
        parts.append(f"<p class='na'>{html.escape(missing)}</p>")
    for s in shown:
        parts.append(f"<h2 id='{s.anchor}'>{html.escape(s.title)}</h2>")
        if s.code:
            parts.append(f"<pre>{html.escape(s.code)}</pre>")
        text = "".join(f"<p>{html.escape(p)}</p>" for p in s.text)
        if s.notes:
            text += (f"<details><summary>Notes ({len(s.notes)}): definitions and caveats</summary>"
                     + "".join(f"<p>{html.escape(p)}</p>" for p in s.notes) + "</details>")
        figs, folded = [], []
        for img, alt, *cap in s.images:
            data = base64.b64encode((out / img).read_bytes()).decode()
            tag = f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"
            if len(cap) > 1 and cap[1] == "collapsed":  # secondary evidence: a <details> block under the figures
                folded.append(f"<details><summary>Figure: {html.escape(alt)}</summary><figure>{tag}<figcaption>"
                              f"{html.escape(cap[0])}</figcaption></figure></details>")
                continue
            cls = f" class='{cap[1]}'" if len(cap) > 1 else ""  # "heatmap": measured by the screenshot test
            figs.append(f"<figure{cls}>{tag}<figcaption>{html.escape(cap[0])}</figcaption></figure>" if cap and cap[0]
                        else f"<figure{cls}>{tag}</figure>" if cls else tag)
        if len(figs) == 1:  # one figure: beside the text
            parts.append(f"<div class='figs'><div>{text}</div>{figs[0]}</div>")
        else:
            parts.append(text)
            if figs:
                parts.append("<div class='figs'>" + "".join(figs) + "</div>")
        parts += folded
        for t in s.tables:
            if t.collapsed:
                parts.append(f"<details><summary>{html.escape(t.caption)}: all {t.frame.height} rows (also "
                             f"tables/{html.escape(t.name)}.csv)</summary>{_html_table(t)}</details>")
            else:
                parts.append(_html_table(t))
    parts.append("</body></html>")
    return "\n".join(parts)
