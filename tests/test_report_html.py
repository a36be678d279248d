"""eval/report.html: one self-contained file with the report's content, rendered by a real headless
Chromium without console errors and not blank."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser

import pytest
from _browser import find_browser, in_ci, ink_share, render
from test_report import make_run

from rlcd.report import write_report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    run, *_ = make_run(tmp_path_factory.mktemp("html"))
    md = write_report(run).read_text()
    return run, md, (run / "eval" / "report.html").read_text()


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.open = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.append((tag, dict(attrs)))
        if tag not in ("meta", "link", "img", "br", "hr", "input"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()


def test_html_is_self_contained_and_carries_the_markdown_content(report):
    run, md, html = report
    tags = _Tags()
    tags.feed(html)
    assert tags.open == [], "every element is closed"
    assert "script" not in tags.tags and not re.search(r"""(src|href)=["']?(https?:|//)""", html)
    images = [a["src"] for t, a in tags.attrs if t == "img"]
    md_images = re.findall(r"!\[[^\]]*\]\((plots/[^)]+\.png)\)", md)
    assert len(images) == len(md_images) >= 9
    for src, rel in zip(images, md_images):
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == (run / "eval" / rel).read_bytes()
    for heading in re.findall(r"^#{2,3} (.+)$", md, flags=re.M):
        assert re.search(r"<h[23]>" + re.escape(heading.replace("&", "&amp;").replace("<", "&lt;")
                                                .replace(">", "&gt;")) + "</h[23]>", html), heading
    for needle in ("raw [95% CI]", "Calibration effect", "Confusion matrices", "worst rows by calibrated NLL",
                   "Accuracy by number of candidates", "RLCD diagnostics", "Recipe"):
        assert needle in html, needle
    assert 'style="background: rgba(' in html  # confusion cells shaded by their row share


@pytest.fixture(scope="module")
def browser():
    path = find_browser()
    if path is None:
        if in_ci():
            pytest.fail("no headless Chromium in CI: `.ci/run` installs chromium-headless-shell with apt-get")
        pytest.skip("no chromium-headless-shell / chromium installed (apt-get install chromium-headless-shell)")
    return path


def test_headless_chromium_renders_the_report(report, browser, tmp_path):
    run, _, _ = report
    shot = tmp_path / "report.png"
    console = render(browser, run / "eval" / "report.html", shot)
    assert console == [], f"console messages: {console}"
    assert shot.read_bytes()[:8] == PNG
    assert ink_share(shot) > 0.03, "the page rendered (nearly) blank"


def test_the_browser_checks_can_fail(browser, tmp_path):
    """The two checks above see a page that logs an error and a page that shows nothing."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"></head><body>'
                   "<p>x</p><script>console.error('planted'); missing();</script></body></html>")
    console = render(browser, bad, tmp_path / "bad.png", height=600)
    assert any("planted" in m for m in console) and any("missing is not defined" in m for m in console)
    blank = tmp_path / "blank.html"
    blank.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"></head>'
                     "<body></body></html>")
    assert render(browser, blank, tmp_path / "blank.png", height=600) == []
    assert ink_share(tmp_path / "blank.png") < 0.001


def test_the_first_screen_shows_the_verdict_lines_and_the_headline_table(report, browser, tmp_path):
    """At 1280 x 900 the first screen is the title, the verdict lines and the headline table with its
    intervals: a page cut right after that table renders, down to the table's last pixel row, exactly
    as the top of the full report does, and that row is above 900."""
    import numpy as np
    from PIL import Image

    run, md, html = report
    assert md.index("## Headline: test split") < md.index("## Temperatures") < md.index("## Data and recipe")
    assert "**Learned vs majority**" in md and "**Calibration effect**" in md and "**Gap to the Bayes floor**" in md
    start = html.index("<h2>Headline: test split")
    assert start < html.index("<nav>") and html.index("raw [95% CI]") < html.index("<nav>")
    cut = html[: html.index("</table></div>", start) + len("</table></div>")] + "</section></main></body></html>"
    (tmp_path / "cut.html").write_text(cut, encoding="utf-8")
    assert render(browser, run / "eval" / "report.html", tmp_path / "full.png", height=900) == []
    assert render(browser, tmp_path / "cut.html", tmp_path / "cut.png", height=900) == []
    full = np.asarray(Image.open(tmp_path / "full.png").convert("L"))
    part = np.asarray(Image.open(tmp_path / "cut.png").convert("L"))
    ink_rows = np.flatnonzero((part < 235).any(axis=1))
    bottom = int(ink_rows[-1]) + 1  # the headline table's last row of pixels
    assert 200 < bottom < 900
    assert np.array_equal(full[:bottom], part[:bottom])
    # and the check can fail: a report with a long preamble pushes the table below the first screen
    pushed = html.replace("<h2>Headline", "<p>" + "filler<br>" * 60 + "</p><h2>Headline", 1)
    (tmp_path / "pushed.html").write_text(pushed, encoding="utf-8")
    assert render(browser, tmp_path / "pushed.html", tmp_path / "pushed.png", height=900) == []
    assert not np.array_equal(np.asarray(Image.open(tmp_path / "pushed.png").convert("L"))[:bottom], part[:bottom])
