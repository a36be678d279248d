"""The report as data: sections of paragraphs, lists, tables and figures, rendered twice.

Every section function returns a ``Section``; ``to_markdown`` writes report.md (figures as links
to ``plots/*.png``) and ``to_html`` one self-contained report.html (figures inlined as base64 PNG,
CSS inlined, no script and no network). Text uses a small inline Markdown subset that both
renderers understand: ```code``` and ``**bold**``.
"""

from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Text:
    text: str
    kind: str = "p"  # "p", or "warn" / "ok" (a highlighted note in HTML, a quoted line in Markdown)


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    header: list[str]
    rows: list[list[Any]]
    shade: list[list[float | None]] | None = None  # 0..1 per cell: HTML background intensity (heat map)
    caption: str | None = None


@dataclass
class Figure:
    path: str  # relative to eval/, e.g. "plots/coverage_risk.png"
    alt: str
    png: bytes
    caption: str | None = None


@dataclass
class Section:
    title: str
    blocks: list[Any] = field(default_factory=list)
    level: int = 2

    def add(self, *blocks: Any) -> "Section":
        self.blocks.extend(b for b in blocks if b is not None)
        return self


def fmt(x: Any, nd: int = 4) -> str:
    """A table cell: floats to ``nd`` decimals, None/non-finite as an em dash, bools as yes/no."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return "—" if not math.isfinite(x) else f"{x:.{nd}f}"
    return str(x)


def fmt_interval(ci: Sequence[Any] | None, nd: int = 4) -> str:
    """``[0.7833, 0.8450]``, or an em dash when there is no interval."""
    if not ci or ci[0] is None or ci[1] is None:
        return "—"
    return f"[{fmt(float(ci[0]), nd)}, {fmt(float(ci[1]), nd)}]"


def fmt_ci(value: Any, ci: Sequence[Any] | None, nd: int = 4) -> str:
    """``0.8150 [0.7833, 0.8450]`` (the value alone when there is no interval)."""
    interval = fmt_interval(ci, nd)
    return fmt(value, nd) if interval == "—" else f"{fmt(value, nd)} {interval}"


# ----------------------------------------------------------------------------------------------
# Markdown


def _md_cell(c: Any) -> str:
    return (c if isinstance(c, str) else fmt(c)).replace("|", "\\|").replace("\n", " ")


def _md_block(b: Any) -> list[str]:
    if isinstance(b, Text):
        return [f"> {b.text}" if b.kind in ("warn", "ok") else b.text, ""]
    if isinstance(b, Bullets):
        return [f"- {item}" for item in b.items] + [""]
    if isinstance(b, Table):
        out = [f"*{b.caption}*", ""] if b.caption else []
        out += ["| " + " | ".join(b.header) + " |", "|" + "|".join("---" for _ in b.header) + "|"]
        out += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
        return out + [""]
    if isinstance(b, Figure):
        return [f"![{b.alt}]({b.path})", ""] + ([b.caption, ""] if b.caption else [])
    if isinstance(b, Section):
        return to_markdown_section(b)
    raise TypeError(f"unknown report block {type(b).__name__}")


def to_markdown_section(s: Section) -> list[str]:
    out = ["#" * s.level + " " + s.title, ""]
    for b in s.blocks:
        out += _md_block(b)
    return out


def to_markdown(title: str, sections: Sequence[Section]) -> str:
    lines = [f"# {title}", ""]
    for s in sections:
        lines += to_markdown_section(s)
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# HTML

CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #1d2330;
       margin: 0; background: #f6f7f9; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; } h2 { font-size: 20px; margin: 36px 0 10px; padding-top: 8px;
border-top: 2px solid #e3e6ec; } h3 { font-size: 16px; margin: 22px 0 8px; } h4 { font-size: 14px; margin: 16px 0 6px; }
nav { columns: 3; font-size: 13px; background: #f0f2f6; padding: 10px 16px; border-radius: 6px; }
nav a { color: #27509b; text-decoration: none; display: block; } nav a:hover { text-decoration: underline; }
table { border-collapse: collapse; margin: 6px 0 14px; font-size: 12.5px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #dde1e8; padding: 3px 8px; text-align: right; vertical-align: top; white-space: nowrap; }
td.t { white-space: normal; overflow-wrap: break-word; max-width: 330px; }
th { background: #eef1f6; text-align: center; } td:first-child, td.t { text-align: left; }
caption { caption-side: top; text-align: left; font-style: italic; color: #555; padding-bottom: 3px; }
code { background: #f0f2f6; padding: 0 3px; border-radius: 3px; font-size: 12.5px; }
figure { margin: 8px 0 18px; } figure img { max-width: 100%; border: 1px solid #e3e6ec; }
figcaption { color: #555; font-size: 12.5px; }
.warn { background: #fff4e0; border-left: 4px solid #e08a00; padding: 6px 10px; }
.ok { background: #eaf6ec; border-left: 4px solid #3c9a4b; padding: 6px 10px; }
.scroll { overflow-x: auto; }
h1 + section > h2 { margin-top: 10px; border-top: none; }
"""


NUMERIC = re.compile(r"^[\s\d.,+\-−\[\]%()—e]*$")  # cells right-aligned in HTML; text cells go left


def inline(text: str) -> str:
    """Escape ``text`` and turn the inline Markdown subset (```code```, ``**bold**``) into HTML."""
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") or "section"


def _shade(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return ""
    v = min(1.0, max(0.0, v))
    return f' style="background: rgba(39, 80, 155, {0.08 + 0.62 * v:.2f}); color: {"#fff" if v > 0.55 else "#111"}"'


def _html_block(b: Any) -> str:
    if isinstance(b, Text):
        cls = f' class="{b.kind}"' if b.kind in ("warn", "ok") else ""
        return f"<p{cls}>{inline(b.text)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        head = "".join(f"<th>{inline(h)}</th>" for h in b.header)
        body = []
        for i, r in enumerate(b.rows):
            cells = []
            for j, c in enumerate(r):
                shade = b.shade[i][j] if b.shade and i < len(b.shade) and j < len(b.shade[i]) else None
                text = c if isinstance(c, str) else fmt(c)
                left = ' class="t"' if not NUMERIC.match(text) else ""
                cells.append(f"<td{left}{_shade(shade)}>{inline(text)}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        cap = f"<caption>{inline(b.caption)}</caption>" if b.caption else ""
        return f'<div class="scroll"><table>{cap}<thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    if isinstance(b, Figure):
        data = base64.b64encode(b.png).decode("ascii")
        cap = f"<figcaption>{inline(b.caption)}</figcaption>" if b.caption else ""
        return f'<figure><img alt="{html.escape(b.alt)}" src="data:image/png;base64,{data}">{cap}</figure>'
    if isinstance(b, Section):
        return _html_section(b)
    raise TypeError(f"unknown report block {type(b).__name__}")


def _html_section(s: Section) -> str:
    level = min(6, s.level)
    return (f'<section id="{_slug(s.title)}"><h{level}>{inline(s.title)}</h{level}>'
            + "\n".join(_html_block(b) for b in s.blocks) + "</section>")


def to_html(title: str, sections: Sequence[Section], *, lead: int = 0) -> str:
    """The page; the first ``lead`` sections come before the table of contents (the first screen)."""
    nav = "".join(f'<a href="#{_slug(s.title)}">{inline(s.title)}</a>' for s in sections)
    first = "".join(_html_section(s) for s in sections[:lead])
    body = "\n".join(_html_section(s) for s in sections[lead:])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            '<link rel="icon" href="data:,">'
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n"
            f"<body><main><h1>{inline(title)}</h1>{first}<nav>{nav}</nav>\n{body}\n</main></body></html>\n")
