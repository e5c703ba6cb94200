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
    def __init__(self):
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.body: dict = {}
        self.cards: list[str] = []
        self._in_card_value = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if tag == "figure" and attrs.get("id", "").startswith("chart-"):
            self.figures[attrs["id"][len("chart-"):]] = attrs
        self._in_card_value = tag == "div" and attrs.get("class") == "value"

    def handle_data(self, data):
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
