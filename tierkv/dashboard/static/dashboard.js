// tierkv dashboard: charts of snapshot lines (schema tierkv.metrics/1), drawn with uPlot.
// Data: window.TIERKV = {mode: "static"} with the lines in the JSON element #tierkv-data, or
// {mode: "live"}: polls api/snapshots?since=N every second. Only the last run in the data is shown.
// Each chart figure element gets data-series = JSON of the chart's own data (uPlot's u.data and
// labels), so a test can read back exactly what is drawn, and data-ticks = the y axis's tick
// labels as drawn; body[data-ready] is set after a draw.
(function () {
  "use strict";
  const config = window.TIERKV || { mode: "live" };
  const COLORS = ["#2f6fde", "#e4572e", "#29a36a", "#9b51e0", "#f2a900", "#17a2b8", "#7a5c3e", "#d6336c"];
  const state = { lines: [], next: 0, charts: {} };
  // A live page left open polls for days: it keeps the newest lines, as many as a JSONL reader keeps.
  const KEEP_LINES = 100000;

  // -- formatting --------------------------------------------------------------------------
  function fmtBytes(v) {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
  }
  const fmtRate = (v) => (v == null ? "–" : fmtBytes(v) + "/s");
  // Axis ticks of byte charts sit on powers of two (256 MiB, 512 MiB, 1 GiB): uPlot picks one of
  // these increments and puts ticks on its multiples; labels drop trailing zeros ("1.5 GiB").
  const BINARY_INCRS = Array.from({ length: 51 }, (_, i) => 2 ** i);
  function fmtBytesTick(v) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return String(Number(v.toFixed(4))) + " " + units[i];
  }
  const fmtRateTick = (v) => fmtBytesTick(v) + "/s";
  const TICK_FORMAT = new Map([[fmtBytes, fmtBytesTick], [fmtRate, fmtRateTick]]);
  const fmtNumTick = (v) => String(Number(v.toPrecision(4)));
  const INTEGER_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];
  const fmtPct = (v) => (v == null ? "–" : (100 * v).toFixed(1) + "%");
  const fmtNum = (v) => (v == null ? "–" : Number.isInteger(v) ? String(v) : v.toPrecision(4));
  const fmtSec = (v) => (v == null ? "–" : v < 1e-3 ? (1e6 * v).toFixed(1) + " µs" : v < 1 ? (1e3 * v).toFixed(2) + " ms" : v.toFixed(2) + " s");

  // -- reading lines -----------------------------------------------------------------------
  function lastRun(lines) {
    if (!lines.length) return [];
    const run = lines[lines.length - 1].run_id;
    return lines.filter((l) => l.run_id === run);
  }
  function tierNames(lines) {
    const names = [];
    for (const line of lines) {
      for (const key of Object.keys(line.figures)) {
        if (!key.startsWith("tier.")) continue;
        const name = key.split(".")[1];
        if (!names.includes(name)) names.push(name);
      }
    }
    return names.sort((a, b) => (a === "gpu" ? -1 : b === "gpu" ? 1 : 0));
  }
  const column = (lines, section, key) => lines.map((l) => { const v = (l[section] || {})[key]; return v === undefined ? null : v; });
  const hasKey = (lines, section, key) => lines.some((l) => key in (l[section] || {}));
  const hasValue = (values) => values.some((v) => v != null);
  const fromZero = (u, min, max) => [0, max > 0 ? max * 1.1 : 1];
  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  }

  // -- chart specs: {x, xTime, series: [{label, values, scale}], fmt, note} -----------------
  function specs(lines) {
    const t = lines.map((l) => l.t);
    const tiers = tierNames(lines);
    const out = {};
    out.hitrate = { x: t, fmt: fmtPct, range: [0, 1], series: tiers.map((n) => ({ label: n, values: column(lines, "rates", `tier.${n}.hit_rate_interval`) })) };
    const bytes = [
      { label: "H2D (CPU→GPU)", values: column(lines, "rates", "transfer.h2d_bytes_per_s") },
      { label: "D2H (GPU→CPU)", values: column(lines, "rates", "transfer.d2h_bytes_per_s") },
    ];
    for (const n of tiers.filter((n) => n !== "gpu")) {
      bytes.push({ label: `${n} read`, values: column(lines, "rates", `tier.${n}.bytes_read_per_s`) });
      bytes.push({ label: `${n} written`, values: column(lines, "rates", `tier.${n}.bytes_written_per_s`) });
    }
    out.bytes = { x: t, fmt: fmtRate, series: bytes, fromZero: true };
    const stalls = [
      { label: "late chunks in interval", values: column(lines, "rates", "scheduler.stalls_interval") },
      { label: "late chunks, total", values: column(lines, "figures", "scheduler.stalls") },
    ];
    const stallTime = column(lines, "rates", "prefetch.stall_s_interval");
    if (hasValue(stallTime)) stalls.push({ label: "stall time in interval", values: stallTime, scale: "s" });
    out.stalls = { x: t, fmt: fmtNum, series: stalls, fromZero: true, note: hasValue(stallTime) ? "" : "Stall time is shown once the scheduler reports wait times." };
    const gpu = [["resident", "gpu.resident_bytes"], ["staging", "gpu.staging_bytes"], ["held", "gpu.held_bytes"],
      ["budget", "gpu.budget_bytes"], ["returned", "gpu.returned_bytes"]]
      .filter(([, key]) => hasKey(lines, "figures", key))
      .map(([label, key]) => ({ label, values: column(lines, "figures", key) }));
    out.gpu = { x: t, fmt: fmtBytes, series: gpu, fromZero: true };
    out.timeline = timelineSpec(lines, t);
    const latencyKeys = [];
    for (const l of lines) for (const k of Object.keys(l.latency || {})) if (!latencyKeys.includes(k)) latencyKeys.push(k);
    out.latency = { x: t, fmt: fmtSec, series: latencyKeys.map((k) => ({ label: k, values: column(lines, "rates", `latency.${k}.mean_s_interval`) })) };
    return out;
  }
  // Each line carries the prefetch chunks consumed since the previous one (prefetch_chunks): one
  // point per chunk at its time since the run started, at the height of its layer; late chunks in
  // their own series; the wait for each chunk on the right-hand axis.
  const TIMELINE_POINTS = 4000;
  function timelineSpec(lines, t) {
    const chunks = lines.filter((l) => l.prefetch_chunks).map((l) => l.prefetch_chunks);
    if (chunks.length) {
      const runStart = lines[0].t - lines[0].elapsed_s;
      const points = [];
      for (const c of chunks) for (let i = 0; i < c.t.length; i++) points.push([c.t[i] - runStart, c.layer[i], c.is_late[i], c.wait_s[i]]);
      points.sort((a, b) => a[0] - b[0]);
      const shown = points.slice(-TIMELINE_POINTS);
      const dropped = points.length - shown.length;
      return { x: shown.map((p) => p[0]), xTime: false, xLabel: "since the run started", xFmt: fmtElapsed, fmt: fmtNum, points: true,
        yIncrs: INTEGER_INCRS, yLabel: "layer",
        note: "Each point is one streamed chunk: its layer, when attention consumed it." + (dropped ? ` Last ${shown.length} chunks.` : ""),
        series: [
          { label: "layer of a chunk on time", values: shown.map((p) => (p[2] ? null : p[1])) },
          { label: "layer of a late chunk", values: shown.map((p) => (p[2] ? p[1] : null)) },
          { label: "wait", values: shown.map((p) => p[3]), scale: "s" },
        ] };
    }
    return { x: t, fmt: fmtNum, note: "This run's scheduler reports no chunk times: chunks streamed and late per snapshot interval.", series: [
      { label: "chunks streamed in interval", values: column(lines, "rates", "scheduler.chunks_streamed_interval") },
      { label: "late chunks in interval", values: column(lines, "rates", "scheduler.stalls_interval") },
    ] };
  }
  const fmtElapsed = (v) => (v == null ? "–" : v < 1 ? Number((1e3 * v).toFixed(1)) + " ms" : Number(v.toFixed(3)) + " s");

  // -- drawing -------------------------------------------------------------------------------
  function draw(id, spec) {
    const el = document.getElementById("chart-" + id);
    const data = [spec.x].concat(spec.series.map((s) => s.values));
    const labels = spec.series.map((s) => s.label);
    const empty = !spec.series.some((s) => hasValue(s.values));
    const shape = JSON.stringify([labels, spec.xTime !== false, spec.note || "", empty]);
    let chart = state.charts[id];
    if (!chart || chart.shape !== shape) {
      if (chart) chart.plot.destroy();
      el.innerHTML = "";
      const title = document.createElement("div");
      title.className = "note";
      title.textContent = [spec.note, empty ? "No data for this chart in this run." : ""].filter(Boolean).join(" ");
      const opts = {
        title: el.dataset.title, width: Math.max(480, el.clientWidth - 16), height: 260,
        scales: { x: { time: spec.xTime !== false }, y: spec.range ? { range: spec.range } : spec.fromZero ? { range: fromZero } : {} },
        series: [{ label: spec.xLabel || "time", value: xLegend(spec) }].concat(spec.series.map((s, i) => ({
          label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: !spec.points, scale: s.scale || "y",
          points: { show: true, size: spec.points ? 6 : 5, fill: spec.points ? COLORS[i % COLORS.length] : undefined },
          paths: spec.points ? () => null : undefined,
          value: legendValue(s.scale === "s" ? fmtSec : spec.fmt),
        }))),
        axes: [spec.xFmt ? { values: (u, vals) => vals.map(spec.xFmt) } : {}, yAxis(el, spec)]
          .concat(spec.series.some((s) => s.scale === "s") ? [{ scale: "s", side: 1, size: 70, grid: { show: false }, values: (u, vals) => vals.map(fmtSec) }] : []),
      };
      const plot = new uPlot(opts, data, el);
      el.appendChild(title);
      chart = state.charts[id] = { plot, shape };
    } else {
      chart.plot.setData(data);
    }
    el.dataset.series = JSON.stringify({ labels, data: chart.plot.data });
  }

  // Legends show the value under the cursor, and the last value of each series when there is no
  // cursor (a static report, or the mouse away from the chart) rather than a dash.
  function legendValue(fmt) {
    return (u, v, seriesIdx, idx) => {
      if (idx != null) return fmt(v);
      const last = lastValue(u.data[seriesIdx]);
      return last == null ? "none" : fmt(last);
    };
  }
  function xLegend(spec) {
    const fmt = spec.xFmt || (spec.xTime === false ? fmtNum : (v) => (v == null ? "–" : new Date(v * 1000).toLocaleTimeString()));
    return legendValue(fmt);
  }
  // The y axis; byte charts tick at multiples of a power of two. Drawn labels go to data-ticks.
  function yAxis(el, spec) {
    const tickFmt = TICK_FORMAT.get(spec.fmt) || (spec.fmt === fmtNum ? fmtNumTick : spec.fmt);
    const axis = { scale: "y", size: 96, label: spec.yLabel, values: (u, vals) => {
      const labels = vals.map(tickFmt);
      el.dataset.ticks = JSON.stringify(labels);
      return labels;
    } };
    if (TICK_FORMAT.has(spec.fmt)) axis.incrs = BINARY_INCRS;
    if (spec.yIncrs) axis.incrs = spec.yIncrs;
    return axis;
  }

  function card(label, value, sub) {
    return `<div class="card"><div class="label">${label}</div><div class="value">${value}</div><div class="sub">${sub || ""}</div></div>`;
  }
  function renderCards(last) {
    const f = last.figures, r = last.rates;
    const gpuHit = f["tier.gpu.hit_rate"];
    const noPredictor = "n/a: no predictor has reported (exact mode)";
    document.getElementById("cards").innerHTML = [
      card("GPU hit rate", fmtPct(gpuHit), `${fmtNum(f["tier.gpu.hits"])} of ${fmtNum(f["tier.gpu.lookups"])} block reads`),
      card("GPU KV held", fmtBytes(f["gpu.held_bytes"]), `budget ${fmtBytes(f["gpu.budget_bytes"])}`),
      card("H2D", fmtBytes(f["transfer.h2d_bytes"]), fmtRate(r["transfer.h2d_bytes_per_s"])),
      card("D2H", fmtBytes(f["transfer.d2h_bytes"]), fmtRate(r["transfer.d2h_bytes_per_s"])),
      card("Stalls", fmtNum(f["scheduler.stalls"]), f["prefetch.stall_s"] == null ? "stall time not reported" : fmtSec(f["prefetch.stall_s"])),
      card("Prefetch precision", f["prefetch.precision"] == null ? "n/a" : fmtPct(f["prefetch.precision"]), f["prefetch.precision"] == null ? noPredictor : ""),
      card("Prefetch recall", f["prefetch.recall"] == null ? "n/a" : fmtPct(f["prefetch.recall"]), f["prefetch.recall"] == null ? noPredictor : ""),
      card("Requests", fmtNum(f["requests.requests"]), `${fmtNum(f["requests.generated_tokens"])} tokens generated`),
    ].join("");
  }
  function quantile(h, q) {
    if (!h || !h.count) return null;
    let seen = 0;
    const bounds = h.buckets_s.concat([Infinity]);
    for (let i = 0; i < h.counts.length; i++) { seen += h.counts[i]; if (seen >= q * h.count) return bounds[i]; }
    return Infinity;
  }
  function renderTables(lines, last) {
    const f = last.figures;
    const rows = tierNames([last]).map((n) => {
      const get = (last.latency || {})[`${n}.get`];
      return [n, f[`tier.${n}.lookups`], f[`tier.${n}.hits`], f[`tier.${n}.misses`], fmtPct(f[`tier.${n}.hit_rate`]),
        fmtBytes(f[`tier.${n}.bytes_read`]), fmtBytes(f[`tier.${n}.bytes_written`]), f[`tier.${n}.evictions`],
        get ? fmtSec(get.count ? get.sum_s / get.count : null) : "–", get ? fmtSec(quantile(get, 0.99)) : "–"];
    });
    table("tiers", ["tier", "lookups", "hits", "misses", "hit rate", "read", "written", "evictions", "get mean", "get p99 ≤"], rows);
    // the last 20 requests, each numbered as the run counted it (requests.requests after it finished)
    const requests = lines.filter((l) => l.request).map((l, i) => [l, i]).slice(-20).map(([l, i]) => {
      const q = l.request;
      const number = l.figures["requests.requests"] ?? i + 1;
      return [String(number), q.prompt_tokens, q.prefix_tokens, blocksByTier(q.prefix_blocks_by_tier), fmtSec(q.prefill_s),
        fmtSec(q.decode_s), q.generated_tokens, fmtPct(q.gpu_hit_rate), fmtBytes(q.h2d_bytes), fmtBytes(q.d2h_bytes), q.stalls];
    });
    table("requests", ["#", "prompt tokens", "reused tokens", "reused KV blocks, by tier *", "prefill", "decode", "generated tokens",
      "GPU hit rate", "H2D", "D2H", "stalls"], requests);
  }
  // {"disk": 254, "cpu": 254} -> "disk 254 blocks, cpu 254 blocks" ("none" when nothing was reused)
  function blocksByTier(byTier) {
    const parts = Object.entries(byTier || {}).map(([tier, n]) => `${tier} ${n} block${n === 1 ? "" : "s"}`);
    return parts.length ? parts.join(", ") : "none";
  }
  function table(id, head, rows) {
    const cell = (v) => `<td>${v == null ? "–" : String(v).replace(/</g, "&lt;")}</td>`;
    document.getElementById(id).innerHTML = `<tr>${head.map((h) => `<th>${h}</th>`).join("")}</tr>` +
      rows.map((r) => `<tr>${r.map(cell).join("")}</tr>`).join("");
  }

  function render() {
    const lines = lastRun(state.lines);
    document.body.dataset.snapshots = String(lines.length);
    if (!lines.length) return;
    const last = lines[lines.length - 1];
    const runs = new Set(state.lines.map((l) => l.run_id)).size;
    document.getElementById("status").textContent = `run ${last.run_id}${runs > 1 ? ` (last of ${runs} in the data)` : ""}: ` +
      `${lines.length} snapshots over ${last.elapsed_s.toFixed(1)} s, last ${new Date(last.t * 1000).toISOString()}`;
    const all = specs(lines);
    for (const id of Object.keys(all)) draw(id, all[id]);
    renderCards(last);
    renderTables(lines, last);
    document.body.dataset.ready = "true";
  }
  function showError(message) {
    const el = document.getElementById("error");
    el.hidden = !message;
    el.textContent = message || "";
  }

  async function poll() {
    try {
      const response = await fetch(`api/snapshots?since=${state.next}`, { cache: "no-store" });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error || response.statusText);
      document.getElementById("source").textContent = body.source || "";
      // concat, not push(...lines): a reply of 100,000 lines (a long file) nears the engine's limit on arguments
      state.lines = state.lines.concat(body.lines);
      if (state.lines.length > KEEP_LINES) state.lines = state.lines.slice(-KEEP_LINES);
      state.next = body.next;
      showError(null);
      if (body.lines.length || !document.body.dataset.ready) render();
    } catch (err) {
      showError("cannot read snapshots: " + err.message);
    }
  }

  if (config.mode === "static") {
    state.lines = JSON.parse(document.getElementById("tierkv-data").textContent);
    document.getElementById("source").textContent = config.source || "";
    render();
    document.body.dataset.ready = "true";
  } else {
    poll();
    setInterval(poll, config.poll_ms || 1000);
  }
})();
