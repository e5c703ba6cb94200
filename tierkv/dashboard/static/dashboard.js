// tierkv dashboard: charts of snapshot lines (schema tierkv.metrics/1), drawn with uPlot.
// Data: window.TIERKV = {mode: "static"} with the lines in the JSON element #tierkv-data, or
// {mode: "live"}: polls api/snapshots?since=N every second. Only the last run in the data is shown.
// Each chart figure element gets data-series = JSON of the chart's own data (uPlot's u.data and
// labels), so a test can read back exactly what is drawn; body[data-ready] is set after a draw.
(function () {
  "use strict";
  const config = window.TIERKV || { mode: "live" };
  const COLORS = ["#2f6fde", "#e4572e", "#29a36a", "#9b51e0", "#f2a900", "#17a2b8", "#7a5c3e", "#d6336c"];
  const state = { lines: [], next: 0, charts: {} };

  // -- formatting --------------------------------------------------------------------------
  function fmtBytes(v) {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
  }
  const fmtRate = (v) => (v == null ? "–" : fmtBytes(v) + "/s");
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
  function timelineSpec(lines, t) {
    const withLayers = lines.filter((l) => l.prefetch_layers);
    if (withLayers.length) {
      const layers = withLayers[withLayers.length - 1].prefetch_layers;
      const x = layers.chunks.map((_, i) => i);
      return { x, xTime: false, xLabel: "layer", fmt: fmtNum, note: "Per layer, since the start of the run.", series: [
        { label: "chunks on time", values: layers.chunks.map((c, i) => c - layers.late_chunks[i]) },
        { label: "late chunks", values: layers.late_chunks.slice() },
        { label: "wait", values: layers.wait_s.slice(), scale: "s" },
      ] };
    }
    return { x: t, fmt: fmtNum, note: "This run's scheduler reports no per-layer events: chunks streamed and late per snapshot interval.", series: [
      { label: "chunks streamed in interval", values: column(lines, "rates", "scheduler.chunks_streamed_interval") },
      { label: "late chunks in interval", values: column(lines, "rates", "scheduler.stalls_interval") },
    ] };
  }

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
        series: [{ label: spec.xLabel || "time" }].concat(spec.series.map((s, i) => ({
          label: s.label, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, scale: s.scale || "y",
          points: { show: true, size: 5 }, value: (u, v) => (s.scale === "s" ? fmtSec(v) : spec.fmt(v)),
        }))),
        axes: [{}, { scale: "y", size: 96, values: (u, vals) => vals.map(spec.fmt) }]
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
    const requests = lines.filter((l) => l.request).slice(-20).map((l, i) => {
      const q = l.request;
      return [String(i + 1), q.prompt_tokens, q.prefix_tokens, JSON.stringify(q.prefix_blocks_by_tier || {}), fmtSec(q.prefill_s),
        fmtSec(q.decode_s), q.generated_tokens, fmtPct(q.gpu_hit_rate), fmtBytes(q.h2d_bytes), fmtBytes(q.d2h_bytes), q.stalls];
    });
    table("requests", ["#", "prompt", "reused", "reused blocks by tier", "prefill", "decode", "generated", "GPU hit rate", "H2D", "D2H", "stalls"], requests);
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
      state.lines.push(...body.lines);
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
