"""The live dashboard page (`tierkv dashboard --endpoint`, a metrics server's page) keeps the newest lines only,
as a JSONL reader does, and takes a first reply of 100,000 lines (a long file) without a RangeError. Runs the
page's own script in Node with a stand-in DOM."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tierkv.dashboard.page import STATIC_DIR

HARNESS = r"""
const fs = require("fs");
const [script, repliesJson] = process.argv.slice(2);
const replies = JSON.parse(repliesJson);  // [[first seq, count], ...]: one reply per poll
const element = () => ({ dataset: {}, textContent: "", innerHTML: "", hidden: true, clientWidth: 800,
                         appendChild() {}, });
const elements = {};
global.window = { TIERKV: { mode: "live", poll_ms: 1000 } };
global.document = {
  body: { dataset: {} },
  getElementById: (id) => (elements[id] = elements[id] || element()),
  createElement: element,
};
global.uPlot = class { constructor(opts, data) { this.data = data; } setData(data) { this.data = data; } destroy() {} };
let poll = null;
global.setInterval = (fn) => { poll = fn; };
let next = 0;
global.fetch = async () => {
  const [first, count] = replies.shift();
  const lines = Array.from({ length: count }, (_, i) => ({ schema: "tierkv.metrics/1", run_id: "r", seq: first + i,
    kind: "interval", t: 1.7e9 + first + i, elapsed_s: first + i, figures: {}, rates: {} }));
  next = first + count;
  return { ok: true, json: async () => ({ lines, next, source: "test" }) };
};
eval(fs.readFileSync(script, "utf8"));  // its first poll starts here
(async () => {
  const seen = [];
  const settle = () => new Promise((resolve) => setTimeout(resolve, 0));
  await settle(); await settle();
  seen.push([document.body.dataset.snapshots, elements.error.textContent]);
  while (replies.length) { await poll(); seen.push([document.body.dataset.snapshots, elements.error.textContent]); }
  console.log(JSON.stringify({ seen, status: elements.status.textContent }));
})();
"""


def test_the_live_page_keeps_the_newest_100000_lines(tmp_path):
    node = shutil.which("node")
    if node is None:  # .ci/run installs it: never skipped there
        message = "node is not installed (apt-get install nodejs; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS)
    replies = [[0, 100_000], [100_000, 30_000], [130_000, 5]]
    run = subprocess.run([node, str(harness), str(STATIC_DIR / "dashboard.js"), json.dumps(replies)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["seen"] == [["100000", ""], ["100000", ""], ["100000", ""]]
    assert "100000 snapshots" in result["status"]
