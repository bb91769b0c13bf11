"""The report rendered: its sections (text, tables, images) as Markdown and as one self-contained
HTML file. Pure: sections in, text out (the images are read from the report directory to embed)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from replay.present.format import cell


@dataclass
class Table:
    name: str  # CSV file stem
    frame: pl.DataFrame
    caption: str
    columns: list[str] | None = None  # shown in md/html (CSV holds all)
    digits: int | dict[str, int] | None = None  # None: each column at its quantity's precision (replay.present.format.PRECISION)
    headers: dict[str, str] | None = None  # md/html header of a column, where its key alone could be misread


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


def _header(t: Table, c: str) -> str:
    return (t.headers or {}).get(c, c)


def md_cell(text: str) -> str:
    """A Markdown table cell: a ``|`` would end the cell (escaped), a newline the row (a space)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _md_table(t: Table) -> str:
    cols = t.columns or t.frame.columns
    rows = t.frame.select(cols).rows()
    out = ["| " + " | ".join(md_cell(_header(t, c)) for c in cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(md_cell(cell(c, v, t.digits)) for c, v in zip(cols, r)) + " |")
    return "\n".join(out)


def _html_table(t: Table) -> str:
    cols = t.columns or t.frame.columns
    head = "".join(f"<th>{html.escape(_header(t, c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(c, v, t.digits))}</td>" for c, v in zip(cols, r)) + "</tr>"
                   for r in t.frame.select(cols).rows())
    return f"<table><caption>{html.escape(t.caption)}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_markdown(title: str, sections: list[Section]) -> str:
    out = [f"# {title}", ""]
    for s in sections:
        out += [f"## {s.title}", ""]
        if s.unavailable:
            out += [f"*Not available for this trace: {s.unavailable}.*", ""]
            continue
        if s.code:
            out += ["```", s.code, "```", ""]
        for p in s.text:
            out += [p, ""]
        for img, alt, *cap in s.images:
            out += [f"![{alt}]({img})", ""] + ([f"*{md_cell(cap[0]).replace('*', chr(92) + '*')}*", ""] if cap and cap[0] else [])
        for t in s.tables:
            out += [f"**{t.caption}** ([CSV](tables/{t.name}.csv))", "", _md_table(t), ""]
    return "\n".join(out)


CSS = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}"
       "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;"
       "text-align:right}caption{text-align:left;font-weight:600;margin-bottom:4px}img{max-width:100%}"
       "pre{background:#f5f5f5;padding:8px;overflow-x:auto}.na{color:#a33;font-style:italic}")


def render_html(title: str, sections: list[Section], out: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.unavailable:
            parts.append(f"<p class='na'>Not available for this trace: {html.escape(s.unavailable)}.</p>")
            continue
        if s.code:
            parts.append(f"<pre>{html.escape(s.code)}</pre>")
        parts += [f"<p>{html.escape(p)}</p>" for p in s.text]
        for img, alt, *cap in s.images:
            data = base64.b64encode((out / img).read_bytes()).decode()
            tag = f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"
            parts.append(f"<figure>{tag}<figcaption>{html.escape(cap[0])}</figcaption></figure>" if cap and cap[0]
                         else f"<p>{tag}</p>")
        parts += [_html_table(t) for t in s.tables]
    parts.append("</body></html>")
    return "\n".join(parts)
