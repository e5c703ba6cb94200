"""Headless Debian Chromium for the dashboard tests: dump the DOM after the page's scripts ran, take
a screenshot. Missing Chromium skips the tests, except under CI (CI set), where it fails them:
.ci/run installs it (apt-get install chromium chromium-driver)."""
from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"


def find_chromium() -> str:
    found = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.access(p, os.X_OK)), None)
    if found is None:
        message = "Debian's chromium is not installed (apt-get install chromium chromium-driver; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def run_chromium(url: str, profile: Path, *extra: str, timeout_s: float = 60.0) -> str:
    """Load `url` in a fresh profile with virtual time (timers and fetches run, then it stops); stdout."""
    args = [find_chromium(), *FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1900",
            "--virtual-time-budget=5000", *extra, url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def dump_dom(url: str, profile: Path) -> str:
    return run_chromium(url, profile, "--dump-dom")


def screenshot(url: str, profile: Path, out: Path) -> Path:
    run_chromium(url, profile, f"--screenshot={out}")
    assert out.is_file() and out.stat().st_size > 10_000, f"no screenshot at {out}"
    return out


class _Collect(HTMLParser):
    """Body and chart attributes, card values, each chart's legend (label -> shown value) and
    each table's rows of cell texts."""

    def __init__(self):
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.body: dict = {}
        self.cards: list[str] = []
        self.legends: dict[str, dict[str, str]] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self._in_card_value = False
        self._figure: str | None = None
        self._table: str | None = None
        self._text_into: str | None = None   # "label", "value" or "cell": the element whose text is collected
        self._text = ""
        self._label = ""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        css = (attrs.get("class") or "").split()
        if tag == "body":
            self.body = attrs
        if tag == "figure" and attrs.get("id", "").startswith("chart-"):
            self._figure = attrs["id"][len("chart-"):]
            self.figures[self._figure] = attrs
            self.legends[self._figure] = {}
        if tag == "table" and attrs.get("id"):
            self._table = attrs["id"]
            self.tables[self._table] = []
        if tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        if self._figure is not None and ("u-label" in css or "u-value" in css):
            self._text_into, self._text = ("label" if "u-label" in css else "value"), ""
        if self._table is not None and tag in ("td", "th"):
            self._text_into, self._text = "cell", ""
        self._in_card_value = tag == "div" and attrs.get("class") == "value"

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None
        if tag == "table":
            self._table = None
        if self._text_into == "label" and tag == "div":
            self._label, self._text_into = self._text, None
        elif self._text_into == "value" and tag == "td":
            self.legends[self._figure][self._label.rstrip(":")] = self._text
            self._text_into = None
        elif self._text_into == "cell" and tag in ("td", "th"):
            self.tables[self._table][-1].append(self._text)
            self._text_into = None

    def handle_data(self, data):
        if self._text_into is not None:
            self._text += data
        if self._in_card_value:
            self.cards.append(data)
            self._in_card_value = False


def parse_dom(html: str) -> _Collect:
    collected = _Collect()
    collected.feed(html)
    return collected


def keep_artifact(path: Path) -> Path:
    """Copy a test output to tests/artifacts/ (git-ignored) so a person can look at it."""
    ARTIFACTS.mkdir(exist_ok=True)
    return Path(shutil.copy(path, ARTIFACTS / path.name))
