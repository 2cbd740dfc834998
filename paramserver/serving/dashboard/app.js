// paramserver dashboard: polls /api/status once a second and draws it (hand-written SVG, no
// libraries, nothing fetched from elsewhere). Errors of the page itself are shown in #errors
// (and counted in its data-count), so a test can read them from the DOM.
"use strict";

const recorded = [];
function recordError(message) {
  recorded.push(String(message));
  const el = document.getElementById("errors");
  if (el) {
    el.hidden = false;
    el.textContent = recorded.join("\n");
    el.dataset.count = String(recorded.length);
  }
}
window.addEventListener("error", (e) =>
  recordError(`error: ${e.message} (${e.filename}:${e.lineno})`));
window.addEventListener("unhandledrejection", (e) => recordError(`unhandled rejection: ${e.reason}`));
const consoleError = console.error.bind(console);
console.error = (...args) => { recordError(args.join(" ")); consoleError(...args); };

const POLL_MS = 1000;
const COLORS = ["#2f6fdf", "#e67e22", "#1e8449", "#c0392b", "#8e44ad", "#16a085", "#d35400",
  "#7f8c8d", "#2c3e50", "#f1c40f", "#e84393", "#00a8ff", "#6ab04c", "#eb4d4b", "#686de0",
  "#30336b"];
const shardHistory = new Map(); // shard index -> [[t, applied updates]]
let polls = 0;
let lastOk = 0;
let history = []; // the server's samples, oldest first; later polls fetch only newer ones

// ------------------------------------------------------------------ formatting
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}
function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return i === 0 ? `${Math.round(n)} B` : `${n.toFixed(1)} ${units[i]}`;
}
function fmtNum(n) {
  if (!isFinite(n)) return "-";
  const a = Math.abs(n);
  if (a >= 1e9) return `${(n / 1e9).toFixed(2)}G`;
  if (a >= 1e6) return `${(n / 1e6).toFixed(2)}M`;
  if (a >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
  if (a >= 100 || Number.isInteger(n)) return String(Math.round(n));
  if (a >= 1) return n.toFixed(1);
  return n.toPrecision(2);
}
function fmtValue(v, unit) {
  return unit === "B/s" ? `${fmtBytes(v)}/s` : `${fmtNum(v)}${unit}`;
}
function fmtSeconds(ms) { return `${(ms / 1000).toFixed(3)} s`; }
function enumName(value, prefix) {
  return String(value || "").replace(prefix, "").toLowerCase();
}
function shape(dims) { return `(${dims.join(", ")}${dims.length === 1 ? "," : ""})`; }

// ------------------------------------------------------------------ charts (SVG)
const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}
function legend(names) {
  const box = el("div", { class: "legend" });
  names.forEach((name, i) => {
    const swatch = el("i");
    swatch.style.background = COLORS[i % COLORS.length];
    box.append(el("span", {}, swatch, name));
  });
  return box;
}

// series: [{name, points: [[x seconds relative to now (<= 0), y]]}]
function lineChart(target, id, series, unit, windowS) {
  const W = 520, H = 180, L = 70, R = 14, T = 10, B = 22;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", "data-chart": id });
  const all = series.flatMap((s) => s.points);
  root.setAttribute("data-points", String(all.length));
  root.setAttribute("data-series", String(series.length));
  const ymax = Math.max(1e-9, ...all.map((p) => p[1])) * 1.1;
  const x = (t) => L + ((t + windowS) / windowS) * (W - L - R);
  const y = (v) => T + (1 - v / ymax) * (H - T - B);
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  root.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
  for (const frac of [0, 0.5, 1]) {
    const v = (ymax / 1.1) * frac;
    const label = svg("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end" });
    label.textContent = fmtValue(v, unit);
    root.append(label);
  }
  for (const t of [-windowS, -windowS / 2, 0]) {
    const label = svg("text", { x: x(t), y: H - 6, "text-anchor": "middle" });
    label.textContent = t === 0 ? "now" : `${Math.round(t)} s`;
    root.append(label);
  }
  if (!all.length) {
    const empty = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    empty.textContent = "no data yet";
    root.append(empty);
  }
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const color = COLORS[i % COLORS.length];
    const pts = s.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { points: pts, fill: "none", stroke: color, "stroke-width": 1.6,
      "data-series": s.name }));
    const [lt, lv] = s.points[s.points.length - 1];
    root.append(svg("circle", { cx: x(lt), cy: y(lv), r: 2.5, fill: color }));
  });
  target.replaceChildren(root, series.length > 1 || (series[0] && series[0].name)
    ? legend(series.map((s) => s.name)) : "");
}

// bars: [{label, value}]
function barChart(target, id, bars, unit) {
  const W = 520, H = 180, L = 70, R = 14, T = 10, B = 34;
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", "data-chart": id });
  root.setAttribute("data-points", String(bars.filter((b) => b.value > 0).length));
  root.setAttribute("data-bars", String(bars.length));
  const vmax = Math.max(1e-9, ...bars.map((b) => b.value)) * 1.1;
  const y = (v) => T + (1 - v / vmax) * (H - T - B);
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
  for (const frac of [0, 0.5, 1]) {
    const v = (vmax / 1.1) * frac;
    const label = svg("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end" });
    label.textContent = `${fmtNum(v)}${unit}`;
    root.append(label);
  }
  const slot = (W - L - R) / Math.max(1, bars.length);
  bars.forEach((b, i) => {
    const bx = L + i * slot + slot * 0.15;
    const rect = svg("rect", { x: bx, y: y(b.value), width: slot * 0.7,
      height: Math.max(0, H - B - y(b.value)), fill: COLORS[b.color ?? 0],
      "data-label": b.label, "data-value": b.value });
    const tip = svg("title");
    tip.textContent = `${b.label}: ${fmtNum(b.value)}${unit}`;
    rect.append(tip);
    root.append(rect);
    const label = svg("text", { x: bx + slot * 0.35, y: H - B + 13, "text-anchor": "middle" });
    label.textContent = b.label.length > 12 ? `${b.label.slice(0, 11)}…` : b.label;
    root.append(label);
  });
  if (!bars.some((b) => b.value > 0)) {
    const empty = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    empty.textContent = "no data yet";
    root.append(empty);
  }
  target.replaceChildren(root);
}

function chartBox(id, caption) {
  let box = document.getElementById(`chart-${id}`);
  if (!box) {
    box = el("div", { id: `chart-${id}` });
    const fig = el("figure", { class: "chart-box" }, el("figcaption", {}, caption), box);
    document.getElementById("charts").append(fig);
  }
  return box;
}

// Rate of a cumulative counter between consecutive samples: [[t - now, per second]].
function rates(history, now, read) {
  const out = [];
  for (let i = 1; i < history.length; i += 1) {
    const dt = history[i].t - history[i - 1].t;
    if (dt <= 0) continue;
    const dv = read(history[i]) - read(history[i - 1]);
    out.push([history[i].t - now, Math.max(0, dv) / dt]); // a restart (counter reset) reads 0
  }
  return out;
}
function windowOf(history, now) {
  return Math.max(60, history.length ? Math.ceil(now - history[0].t) : 60);
}
function labelsOf(history, field) {
  const names = new Set();
  for (const h of history) for (const k of Object.keys(h[field] || {})) names.add(k);
  return [...names].sort();
}

// ------------------------------------------------------------------ tables
function table(id, headers, rows) {
  const node = document.getElementById(id);
  const head = el("tr", {}, ...headers.map(([h, cls]) => el("th", { class: cls || "" }, h)));
  node.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows));
}
function cell(text, field, value, cls = "num") {
  const attrs = { class: cls, "data-field": field };
  if (value !== undefined) attrs["data-value"] = String(value);
  return el("td", attrs, text);
}
function card(label, value, field, raw) {
  const attrs = { class: "value", "data-field": field };
  if (raw !== undefined) attrs["data-value"] = String(raw);
  return el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", attrs, value));
}

// ------------------------------------------------------------------ parameter-server shard
function renderPs(data) {
  const st = data.status || {};
  const view = st.view || {};
  const info = data.server || {};
  const consistency = enumName(view.consistency, "CONSISTENCY_");
  const bsp = consistency === "bsp";
  const workers = st.workers || [];
  const live = workers.filter((w) => w.live).length;
  const ckptAge = st.last_checkpoint_age_ms;
  const wal = info.wal ? `on, seq ${st.wal_sequence}` : "off";
  const cards = [
    card("mode", `${info.mode || "ps"} · shard ${info.shard_index}/${info.num_shards}`, "mode"),
    card("consistency", consistency === "asp" ? "ASP"
      : `${consistency.toUpperCase()}${consistency === "ssp" ? ` (s=${view.staleness})` : ""}`,
    "consistency", consistency),
    card("shards", String(info.num_shards), "shards", info.num_shards),
    card("live workers", `${live} / ${workers.length}`, "live_workers", view.live_workers),
    card("min clock", String(view.min_clock), "min_clock", view.min_clock),
  ];
  if (bsp) cards.push(card("BSP step", String(st.bsp_step), "bsp_step", st.bsp_step));
  cards.push(
    card("applied updates", String(st.applied_updates), "applied_updates", st.applied_updates),
    card("dropped / rejected", `${st.dropped_stale} / ${st.rejected_pushes}`, "refused"),
    card("last checkpoint", ckptAge ? `${(ckptAge / 1000).toFixed(1)} s ago`
      : (info.checkpoint_dir ? "none yet" : "off"), "last_checkpoint"),
    card("WAL", wal, "wal", st.wal_sequence),
    card("pushes in flight", String(st.inflight_pushes), "inflight_pushes", st.inflight_pushes),
    card("RSS", fmtBytes(st.rss_bytes || 0), "rss_bytes", st.rss_bytes),
    card("version", `paramserver ${data.version}`, "version", data.version),
  );
  document.getElementById("summary").replaceChildren(...cards);

  // Workers, slowest first (as `paramserver status` ranks them).
  const order = [...workers].sort((a, b) =>
    (a.live === b.live ? 0 : a.live ? -1 : 1)
    || (bsp ? b.barrier_lag_ms - a.barrier_lag_ms : 0)
    || a.clock - b.clock || a.worker_name.localeCompare(b.worker_name));
  document.getElementById("workers-section").hidden = false;
  table("workers", [["#", "num"], ["name"], ["live"], ["clock", "num"], ["lease left", "num"],
    ["heartbeat age", "num"], ["barrier lag", "num"], ["barrier wait", "num"],
    ["steps", "num"], ["applied", "num"]],
  order.map((w, i) => el("tr", { class: `worker-row${w.live ? "" : " departed"}`,
    "data-worker": w.worker_name },
  cell(String(i + 1), "rank"),
  cell(w.worker_name, "name", w.worker_name, ""),
  el("td", { "data-field": "live", "data-value": String(w.live) },
    el("span", { class: `tag ${w.live ? "ok" : "bad"}` }, w.live ? "live" : "gone")),
  cell(String(w.clock), "clock", w.clock),
  cell(w.live ? fmtSeconds(w.lease_remaining_ms) : "-", "lease_remaining_ms",
    w.lease_remaining_ms),
  cell(fmtSeconds(w.heartbeat_age_ms), "heartbeat_age_ms", w.heartbeat_age_ms),
  cell(fmtSeconds(w.barrier_lag_ms), "barrier_lag_ms", w.barrier_lag_ms),
  cell(fmtSeconds(w.barrier_wait_ms), "barrier_wait_ms", w.barrier_wait_ms),
  cell(String(w.barrier_steps), "barrier_steps", w.barrier_steps),
  cell(String(w.applied_updates), "applied_updates", w.applied_updates))));

  const keyRates = data.key_rates || {};
  document.getElementById("keys-section").hidden = false;
  table("keys", [["key"], ["dtype"], ["shape"], ["bytes", "num"], ["rule"], ["updates", "num"],
    ["push/s", "num"], ["pull/s", "num"]],
  (st.keys || []).map((k) => {
    const r = keyRates[k.key] || { push_bytes_per_s: 0, pull_bytes_per_s: 0 };
    return el("tr", { class: "key-row", "data-key": k.key },
      cell(k.key, "key", k.key, ""),
      cell(enumName(k.dtype, "DTYPE_"), "dtype", undefined, ""),
      cell(shape(k.shape || []), "shape", undefined, ""),
      cell(fmtBytes(k.size_bytes), "size_bytes", k.size_bytes),
      cell(enumName(k.rule, "RULE_KIND_"), "rule", undefined, ""),
      cell(String(k.updates), "updates", k.updates),
      cell(`${fmtBytes(r.push_bytes_per_s)}/s`, "push_bytes_per_s", r.push_bytes_per_s),
      cell(`${fmtBytes(r.pull_bytes_per_s)}/s`, "pull_bytes_per_s", r.pull_bytes_per_s));
  }));

  // Embedding tables: what users watch per table (as `paramserver status` shows it).
  const tables = st.tables || [];
  document.getElementById("tables-section").hidden = tables.length === 0;
  table("tables", [["table"], ["dim", "num"], ["dtype"], ["rows", "num"], ["bytes/row", "num"],
    ["pulled/s", "num"], ["pushed/s", "num"], ["filtered", "num"], ["expired", "num"],
    ["cache hit", "num"]],
  tables.map((t) => {
    const asked = t.cache_rows_requested || 0;
    const hit = asked ? (100 * (t.cache_rows_hit || 0)) / asked : null;
    return el("tr", { class: "table-row", "data-table": t.spec.name },
      cell(t.spec.name, "name", t.spec.name, ""),
      cell(String(t.spec.dim), "dim", t.spec.dim),
      cell(enumName(t.spec.dtype, "DTYPE_"), "dtype", undefined, ""),
      cell(String(t.rows), "rows", t.rows),
      cell(t.rows ? t.bytes_per_row.toFixed(1) : "-", "bytes_per_row", t.bytes_per_row),
      cell(t.rows_pulled_per_s.toFixed(0), "rows_pulled_per_s", t.rows_pulled_per_s),
      cell(t.rows_pushed_per_s.toFixed(0), "rows_pushed_per_s", t.rows_pushed_per_s),
      cell(String(t.filtered), "filtered", t.filtered),
      cell(String(t.expired), "expired", t.expired),
      cell(hit === null ? "-" : `${hit.toFixed(1)}%`, "cache_hit_rate", hit === null ? "" : hit));
  }));

  const h = data.history || [];
  const now = data.now_unix_s;
  const win = windowOf(h, now);
  lineChart(chartBox("pushes", "pushes/s (applied or queued)"), "pushes",
    [{ name: "", points: rates(h, now, (s) => s.pushes) }], "/s", win);
  lineChart(chartBox("pull-bytes", "pulled bytes/s"), "pull-bytes",
    [{ name: "", points: rates(h, now, (s) => s.pull_bytes) }], "B/s", win);

  // Staleness in clocks: the gradients applied over the window (since start if none).
  const bounds = (data.staleness_clock_bounds || []).map(String).concat(["+Inf"]);
  const first = h.length ? h[0].staleness_clocks : [];
  const last = h.length ? h[h.length - 1].staleness_clocks : [];
  const cum = (arr, i) => (arr && arr[i]) || 0;
  let counts = bounds.map((_, i) => cum(last, i) - (i ? cum(last, i - 1) : 0)
    - (cum(first, i) - (i ? cum(first, i - 1) : 0)));
  let span = `last ${Math.round(win)} s`;
  if (!counts.some((c) => c > 0)) {
    counts = bounds.map((_, i) => cum(last, i) - (i ? cum(last, i - 1) : 0));
    span = "since start";
  }
  barChart(chartBox("staleness", "staleness of applied gradients (clocks)"), "staleness",
    bounds.map((b, i) => ({ label: b === "+Inf" ? `>${bounds[i - 1]}` : `≤${b}`, value: counts[i],
      color: 0 })), "");
  document.querySelector("#chart-staleness").parentElement.querySelector("figcaption")
    .textContent = `staleness of applied gradients, clocks (${span})`;

  // Barrier lag per worker: mean seconds per BSP step over the window (since start if none).
  const lagNames = labelsOf(h, "barrier_lag_s");
  const lagBars = lagNames.map((name, i) => {
    const a = h.find((s) => name in (s.barrier_lag_s || {}));
    const b = h[h.length - 1];
    const lag = ((b.barrier_lag_s || {})[name] || 0) - ((a.barrier_lag_s || {})[name] || 0);
    const steps = ((b.barrier_steps || {})[name] || 0) - ((a.barrier_steps || {})[name] || 0);
    const totalSteps = (b.barrier_steps || {})[name] || 0;
    const value = steps > 0 ? (lag / steps) * 1000
      : totalSteps > 0 ? (((b.barrier_lag_s || {})[name] || 0) / totalSteps) * 1000 : 0;
    return { label: name, value, color: i % COLORS.length };
  });
  barChart(chartBox("barrier-lag", bsp ? "BSP barrier lag per worker (ms per step)"
    : "BSP barrier lag per worker (BSP only)"), "barrier-lag", lagBars, " ms");

  lineChart(chartBox("heartbeat", "heartbeat latency: server handling time (ms)"), "heartbeat",
    [{ name: "", points: h.slice(1).map((s, i) => {
      const n = s.heartbeats - h[i].heartbeats;
      return n > 0 ? [s.t - now, ((s.heartbeat_s - h[i].heartbeat_s) / n) * 1000] : null;
    }).filter(Boolean) }], " ms", win);

  renderShards(data, st, now, win);
}

function renderShards(data, own, now, win) {
  const section = document.getElementById("shards-section");
  if (!data.shards) { section.hidden = true; return; }
  section.hidden = false;
  const info = data.server || {};
  const entries = [{ index: info.shard_index, address: info.address, status: own },
    ...data.shards].sort((a, b) => a.index - b.index);
  for (const e of entries) {
    if (!e.status) continue;
    const list = shardHistory.get(e.index) || [];
    list.push([now, e.status.applied_updates]);
    while (list.length && now - list[0][0] > 300) list.shift();
    shardHistory.set(e.index, list);
  }
  table("shards", [["shard", "num"], ["address"], ["live workers", "num"], ["min clock", "num"],
    ["applied", "num"], ["keys", "num"], ["WAL seq", "num"], ["state"]],
  entries.map((e) => {
    const s = e.status;
    if (!s) {
      return el("tr", { class: "shard-row", "data-shard": String(e.index) },
        cell(String(e.index), "index", e.index), cell(e.address, "address", undefined, ""),
        el("td", { colspan: 5 }, ""), el("td", {}, el("span", { class: "tag bad" }, e.error)));
    }
    return el("tr", { class: "shard-row", "data-shard": String(e.index) },
      cell(String(e.index), "index", e.index), cell(e.address, "address", undefined, ""),
      cell(String(s.view.live_workers), "live_workers", s.view.live_workers),
      cell(String(s.view.min_clock), "min_clock", s.view.min_clock),
      cell(String(s.applied_updates), "applied_updates", s.applied_updates),
      cell(String((s.keys || []).length), "keys", (s.keys || []).length),
      cell(String(s.wal_sequence), "wal_sequence", s.wal_sequence),
      el("td", {}, el("span", { class: "tag ok" }, "serving")));
  }));
  const series = [...shardHistory.entries()].sort((a, b) => a[0] - b[0]).map(([index, list]) => ({
    name: `shard ${index}`,
    points: list.slice(1).map(([t, v], i) => {
      const [t0, v0] = list[i];
      return [t - now, t > t0 ? Math.max(0, v - v0) / (t - t0) : 0];
    }),
  }));
  lineChart(document.getElementById("chart-shards"), "shards", series, "/s", win);
}

// ------------------------------------------------------------------ rank server
function renderRank(data) {
  const info = data.server || {};
  const h = data.history || [];
  const last = h[h.length - 1] || {};
  const tiers = Object.entries(info.tier_blocks || {}).filter(([, n]) => n > 0)
    .map(([t, n]) => `${t} ${n}`).join(", ") || "-";
  document.getElementById("summary").replaceChildren(
    card("instance / rank", `${info.instance_id} / ${info.rank}`, "rank", info.rank),
    card("tiers (blocks)", tiers + (info.object_store ? ", G4 objects" : ""), "tiers"),
    card("commands in flight", String(last.inflight ?? 0), "inflight", last.inflight),
    card("commands failed", String(last.failed ?? 0), "failed", last.failed),
    card("version", `paramserver ${data.version}`, "version", data.version),
  );
  const now = data.now_unix_s;
  const win = windowOf(h, now);
  const names = labelsOf(h, "transfer_bytes");
  lineChart(chartBox("transfer-bytes", "transfer throughput per tier and path (bytes/s)"),
    "transfer-bytes", names.map((name) => ({ name,
      points: rates(h, now, (s) => (s.transfer_bytes || {})[name] || 0) })), "B/s", win);
  lineChart(chartBox("transfers", "commands/s per tier and path"), "transfers",
    names.map((name) => ({ name, points: rates(h, now, (s) => (s.transfers || {})[name] || 0) })),
    "/s", win);
  document.getElementById("transfers-section").hidden = false;
  const prev = h.length > 1 ? h[h.length - 2] : last;
  const dt = Math.max(1e-9, (last.t || 0) - (prev.t || 0));
  table("transfers", [["direction tiers path"], ["commands", "num"], ["bytes", "num"],
    ["now", "num"], ["mean GB/s", "num"]],
  names.map((name) => {
    const bytes = (last.transfer_bytes || {})[name] || 0;
    const secs = (last.transfer_s || {})[name] || 0;
    const rate = (bytes - ((prev.transfer_bytes || {})[name] || 0)) / dt;
    return el("tr", { class: "transfer-row", "data-transfer": name },
      cell(name, "name", name, ""),
      cell(String((last.transfers || {})[name] || 0), "transfers", (last.transfers || {})[name]),
      cell(fmtBytes(bytes), "bytes", bytes),
      cell(`${fmtBytes(Math.max(0, rate))}/s`, "bytes_per_s", rate),
      cell(secs > 0 ? (bytes / secs / 1e9).toFixed(3) : "-", "gbps"));
  }));
}

// ------------------------------------------------------------------ reduction server
function renderRpcs(data) {
  const h = data.history || [];
  const now = data.now_unix_s;
  document.getElementById("summary").replaceChildren(
    card("mode", data.kind, "mode"), card("version", `paramserver ${data.version}`, "version"));
  const names = labelsOf(h, "rpcs");
  lineChart(chartBox("rpcs", "RPCs/s per method"), "rpcs", names.map((name) => ({ name,
    points: rates(h, now, (s) => (s.rpcs || {})[name] || 0) })), "/s", windowOf(h, now));
}

// ------------------------------------------------------------------ polling
function render(data) {
  document.getElementById("kind").textContent = data.kind === "ps" ? "shard"
    : data.kind === "rank" ? "rank server" : `${data.kind} server`;
  const info = data.server || {};
  document.getElementById("where").textContent = info.address || location.host;
  if (data.kind === "ps") renderPs(data);
  else if (data.kind === "rank") renderRank(data);
  else renderRpcs(data);
}

async function poll() {
  let data = null;
  try {
    const since = history.length ? `?since=${history[history.length - 1].t}` : "";
    const resp = await fetch(`/api/status${since}`, { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    data = await resp.json();
  } catch (err) {
    // The server restarting or gone is a state to show, not a page error.
    const ago = lastOk ? ` (last update ${Math.round((Date.now() - lastOk) / 1000)} s ago)` : "";
    document.getElementById("freshness").textContent = `cannot reach the server: ${err}${ago}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
  if (data === null) return;
  history = history.concat(data.history || []);
  const keepS = (data.period_s || 1) * 300;
  while (history.length && data.now_unix_s - history[0].t > keepS) history.shift();
  data.history = history;
  render(data); // a rendering error is a page error (recorded in #errors)
  polls += 1;
  lastOk = Date.now();
  document.body.dataset.polls = String(polls);
  document.getElementById("freshness").textContent =
    `updated ${new Date(data.now_unix_s * 1000).toLocaleTimeString()}`;
}

poll();
