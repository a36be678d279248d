"""A real headless browser for the HTML report test: find it, render a page, read what it logged.

Debian packages `chromium-headless-shell` and `chromium` (`.ci/run` installs the first when neither
is present). Rendering uses Chromium's own `--screenshot` (no DevTools, no Python driver); with
`--enable-logging=stderr --v=0` every console message of the page (errors, uncaught exceptions)
is a `...:CONSOLE:<line>] "<message>", source: <url> (<line>)` line on stderr.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]\s*(.*)")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def render(browser: str, page: Path, screenshot: Path, *, width: int = 1280, height: int = 4000) -> list[str]:
    """Render ``page`` to ``screenshot`` (PNG); returns the page's console messages."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-dev-shm-usage", "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
           f"--screenshot={screenshot}", f"--window-size={width},{height}", page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or not screenshot.is_file():
        raise RuntimeError(f"{browser} failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return [m.group(1) for m in map(CONSOLE.search, out.stderr.splitlines()) if m]


def ink_share(png: Path) -> float:
    """Share of pixels that are not (near) white: 0 for a blank page."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("L"), dtype=np.uint8)
    return float((pixels < 235).mean())
