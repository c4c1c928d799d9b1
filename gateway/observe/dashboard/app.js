// tokengate's built-in dashboard: polls /stats and draws on <canvas>. No build step, no CDN.
"use strict";

const POLL_MS = 2000;
const LIVE_POINTS = 180; // client-side history for live series (in-flight, HOL r)
const COLORS = ["#58a6ff", "#f0883e", "#3fb950", "#d2a8ff", "#f85149", "#e3b341", "#39c5cf", "#ff7b72"];

const live = { t0: performance.now(), inflight: {}, hol: {}, reserved: {} };
const colorOf = {};
let colorNext = 0;
function color(name) {
  if (!(name in colorOf)) colorOf[name] = COLORS[colorNext++ % COLORS.length];
  return colorOf[name];
}

function fmtS(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  if (v < 0.01) return (v * 1000).toFixed(v < 0.001 ? 3 : 1) + " ms";
  return v < 1 ? (v * 1000).toFixed(0) + " ms" : v.toFixed(2) + " s";
}
function fmtN(v) {
  if (v === null || v === undefined) return "–";
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (v !== Math.round(v) && Math.abs(v) < 10) return v.toFixed(2).replace(/\.?0+$/, "");
  return String(Math.round(v));
}
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function bar(frac) {
  const d = el("div", null, "bar" + (frac >= 0.95 ? " hot" : frac >= 0.8 ? " warm" : ""));
  const s = el("span");
  s.style.width = Math.max(0, Math.min(1, frac || 0)) * 100 + "%";
  d.appendChild(s);
  return d;
}
// A histogram in a table cell: one bar per bucket, height by count; buckets above 1 (the answer
// outgrew its reservation) in the warning colour.
function histBars(buckets) {
  const d = el("div", null, "hist");
  const max = Math.max(1, ...buckets.map((b) => b.count));
  for (const b of buckets) {
    const s = el("span", null, !b.count ? "empty" : b.le === null || b.le > 1 ? "over" : "");
    s.style.height = Math.max(b.count ? 2 : 1, Math.round((b.count / max) * 18)) + "px";
    s.title = (b.le === null ? "above" : "≤ " + b.le) + ": " + b.count;
    d.appendChild(s);
  }
  return d;
}
function fmtRatio(v) { return v === null || v === undefined ? "–" : v.toFixed(2) + "×"; }
function fmtLe(v, n) { return !n ? "–" : v === null ? "> 4×" : v + "×"; }

function fillTable(id, rows) {
  const tb = document.querySelector("#" + id + " tbody");
  tb.replaceChildren();
  for (const cells of rows) {
    const tr = el("tr");
    for (const c of cells) {
      if (c instanceof Node) { const td = el("td"); td.appendChild(c); tr.appendChild(td); }
      else if (typeof c === "object" && c !== null) tr.appendChild(el("td", c.text, c.cls));
      else tr.appendChild(el("td", c));
    }
    tb.appendChild(tr);
  }
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "none yet", "hint");
    td.colSpan = 8;
    tr.appendChild(td);
    tb.appendChild(tr);
  }
}

// ---- a small line chart: series = [{name, color, points: [[x, y], ...], dashed}] ----
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}
function drawChart(canvas, series, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const L = 56, R = 10, T = 8, B = 36;
  let xmin = Infinity, xmax = -Infinity, ymax = opts.ymin_max || 0;
  let points = 0;
  for (const s of series) for (const [x, y] of s.points) {
    if (y === null || y === undefined) continue;
    xmin = Math.min(xmin, x); xmax = Math.max(xmax, x);
    if (!s.dashed) { ymax = Math.max(ymax, y); points++; }
  }
  // Reference lines (SLOs, thresholds) widen the scale only when near the data, so a loose SLO
  // does not flatten the curves; a line far above the data is simply not drawn.
  const dataMax = ymax;
  for (const s of series) if (s.dashed) for (const [, y] of s.points) {
    if (y !== null && y !== undefined && (y <= dataMax * 3 || !points)) ymax = Math.max(ymax, y);
  }
  if (opts.xmin !== undefined) xmin = Math.min(xmin, opts.xmin);
  if (opts.xmax !== undefined) xmax = Math.max(xmax, opts.xmax);
  if (!isFinite(xmin)) { xmin = -60; xmax = 0; }
  if (xmax - xmin < 1) xmin = xmax - 1;
  const ylo = opts.ylo !== undefined ? opts.ylo : 0;
  const yhi = opts.yhi !== undefined ? opts.yhi : niceMax(ymax * 1.1);
  const X = (x) => L + (x - xmin) / (xmax - xmin) * (w - L - R);
  const Y = (y) => T + (1 - (y - ylo) / (yhi - ylo)) * (h - T - B);
  ctx.font = "11px DejaVu Sans, sans-serif";
  ctx.strokeStyle = "#2a3541"; ctx.fillStyle = "#8a96a3"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = ylo + (yhi - ylo) * i / 4, py = Y(y);
    ctx.beginPath(); ctx.moveTo(L, py); ctx.lineTo(w - R, py); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(opts.fmt(y), L - 4, py + 4);
  }
  ctx.textAlign = "center";
  for (let i = 0; i <= 4; i++) {
    const x = xmin + (xmax - xmin) * i / 4;
    const span = xmax - xmin;
    ctx.textAlign = i === 4 ? "right" : i === 0 ? "left" : "center";
    ctx.fillText((span < 10 ? x.toFixed(1) : Math.round(x)) + " s", X(x), h - B + 14);
  }
  for (const s of series) {
    if (s.dashed && s.points.some(([, y]) => y > yhi)) continue;
    ctx.strokeStyle = s.color; ctx.lineWidth = s.dashed ? 1 : 2;
    ctx.setLineDash(s.dashed ? [5, 4] : []);
    ctx.beginPath();
    let pen = false;
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = false; continue; }
      const px = X(x), py = Y(Math.min(Math.max(y, ylo), yhi));
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
    }
    ctx.stroke();
    if (!s.dashed) {
      ctx.fillStyle = s.color;
      for (const [x, y] of s.points) if (y !== null && y !== undefined) {
        ctx.beginPath(); ctx.arc(X(x), Y(Math.min(Math.max(y, ylo), yhi)), 2, 0, 2 * Math.PI); ctx.fill();
      }
    }
  }
  ctx.setLineDash([]);
  // legend
  let lx = L;
  ctx.textAlign = "left";
  for (const s of series) {
    if (s.dashed) continue;
    ctx.fillStyle = s.color; ctx.fillRect(lx, h - 14, 10, 10);
    ctx.fillStyle = "#d8dee6"; ctx.fillText(s.name, lx + 14, h - 5);
    lx += 24 + ctx.measureText(s.name).width;
  }
  if (!points) { ctx.fillStyle = "#8a96a3"; ctx.textAlign = "center"; ctx.fillText("no data yet", (L + w - R) / 2, (T + h - B) / 2); }
  canvas.dataset.points = String(points);
}

function pushLive(store, key, t, v) {
  const arr = store[key] || (store[key] = []);
  arr.push([t, v]);
  if (arr.length > LIVE_POINTS) arr.shift();
}
function liveSeries(store, now) {
  return Object.keys(store).sort().map((k) => ({
    name: k, color: color(k), points: store[k].map(([t, v]) => [t - now, v]),
  }));
}

function render(st) {
  const now = (performance.now() - live.t0) / 1000;
  const classes = st.classes || [];

  // findings
  const ul = document.getElementById("findings");
  ul.replaceChildren();
  for (const f of st.findings || []) ul.appendChild(el("li", f.text, f.level));
  if (!(st.findings || []).length) ul.appendChild(el("li", "nothing to report", "ok"));

  // charts from server windows
  const ttft = [], queue = [];
  for (const c of classes) {
    ttft.push({ name: c.name, color: color(c.name), points: c.series.map((p) => [p.t, p.ttft_p99]) });
    queue.push({ name: c.name, color: color(c.name), points: c.series.map((p) => [p.t, p.queue_wait_p99]) });
    const xs = c.series.map((p) => p.t);
    const x0 = xs.length ? Math.min(...xs) : -60;
    if (c.slo && c.slo.ttft_p99_s) ttft.push({ name: c.name + " SLO", color: color(c.name), dashed: true, points: [[x0, c.slo.ttft_p99_s], [0, c.slo.ttft_p99_s]] });
    if (c.slo && c.slo.queue_wait_p99_s) queue.push({ name: c.name + " SLO", color: color(c.name), dashed: true, points: [[x0, c.slo.queue_wait_p99_s], [0, c.slo.queue_wait_p99_s]] });
    pushLive(live.inflight, c.name, now, c.inflight_tokens);
  }
  drawChart(document.getElementById("chart-ttft"), ttft, { fmt: fmtS, xmax: 0 });
  drawChart(document.getElementById("chart-queue"), queue, { fmt: fmtS, xmax: 0 });
  drawChart(document.getElementById("chart-inflight"), liveSeries(live.inflight, now), { fmt: fmtN, xmax: 0, ymin_max: 100 });

  const hol = st.hol || { pairs: [] };
  for (const p of hol.pairs) pushLive(live.hol, p.victim + " ← " + p.aggressor, now, p.correlation);
  const holSeries = liveSeries(live.hol, now);
  if (hol.threshold) {
    const x0 = holSeries.length ? Math.min(...holSeries.flatMap((s) => s.points.map((q) => q[0]))) : -60;
    holSeries.push({ name: "threshold", color: "#f85149", dashed: true, points: [[x0, hol.threshold], [0, hol.threshold]] });
  }
  drawChart(document.getElementById("chart-hol"), holSeries, { fmt: (v) => v.toFixed(1), ylo: -1, yhi: 1, xmax: 0 });

  // output reservations: how well they fit, and the capacity they hold beside what is really used
  const res = st.reservations || { classes: [], pools: [], extensions: {}, learned: [] };
  for (const p of res.pools) {
    pushLive(live.reserved, p.pool + " reserved", now, p.reserved_share || 0);
    pushLive(live.reserved, p.pool + " in backend", now, p.used_share || 0);
  }
  drawChart(document.getElementById("chart-reserved"), liveSeries(live.reserved, now), {
    fmt: (v) => (v * 100).toFixed(0) + " %", xmax: 0, ymin_max: 0.1,
  });

  // tables
  fillTable("classes", classes.map((c) => {
    const r = c.recent || {};
    const g = (s, q) => (r[s] || {})[q];
    const over = (v, lim) => (lim && v !== null && v !== undefined && v > lim ? "bad" : "");
    return [
      c.name,
      { text: fmtS(g("ttft", "p50")), cls: "num" },
      { text: fmtS(g("ttft", "p99")), cls: "num " + over(g("ttft", "p99"), c.slo.ttft_p99_s) },
      { text: fmtS(g("queue_wait", "p99")), cls: "num " + over(g("queue_wait", "p99"), c.slo.queue_wait_p99_s) },
      { text: fmtS(g("backend", "p99")), cls: "num" },
      { text: fmtS(g("e2e", "p99")), cls: "num" },
      { text: fmtN(c.inflight_tokens), cls: "num" },
      fmtS(c.slo.ttft_p99_s) + " / " + fmtS(c.slo.queue_wait_p99_s),
    ];
  }));
  fillTable("pools", (st.pools || []).map((p) => [
    p.kind + ":" + p.name, { text: fmtN(p.in_flight) + " / " + fmtN(p.capacity), cls: "num" }, bar(p.utilisation),
  ]));
  fillTable("queues", Object.keys(st.queues || {}).sort().map((k) => [k, { text: String(st.queues[k]), cls: "num" }]));
  fillTable("backends", (st.backends || []).map((b) => {
    const kvCell = el("div");
    kvCell.appendChild(bar(b.kv_usage || 0));
    kvCell.appendChild(el("small", b.kv_usage === null ? "–" : (b.kv_usage * 100).toFixed(0) + " %"));
    return [
      b.backend, b.pool, kvCell,
      { text: fmtN(b.running) + " / " + fmtN(b.waiting), cls: "num" },
      { text: (b.preemptions_per_s || 0).toFixed(2), cls: "num" },
      { text: (b.penalty || 0).toFixed(2), cls: "num" },
      {
        text: (b.health && b.health !== "up" ? b.health + " · " : "") + b.reason,
        cls: b.saturated || b.health === "down" ? "bad" : "good",
      },
    ];
  }));
  fillTable("tenants", (st.tenants || []).map((t) => [
    t.name, { text: fmtN(t.in_flight) + " / " + fmtN(t.capacity), cls: "num" },
    { text: String(t.queued), cls: "num" }, { text: fmtN(t.virtual_service), cls: "num" },
  ]));
  fillTable("hol", (hol.pairs || []).map((p) => [
    p.victim, p.aggressor,
    { text: p.correlation.toFixed(2), cls: "num " + (p.correlation >= hol.threshold ? "bad" : "") },
    { text: p.r_p99 === null ? "–" : p.r_p99.toFixed(2), cls: "num" },
    { text: p.r_inflight === null ? "–" : p.r_inflight.toFixed(2), cls: "num" },
    { text: String(p.windows), cls: "num" },
  ]));
  fillTable("reservations", res.classes.map((r) => [
    r.class, r.tenant, { text: fmtN(r.requests), cls: "num" },
    { text: fmtRatio(r.ratio_mean), cls: "num" },
    { text: fmtLe(r.ratio_p50_le, r.requests), cls: "num" },
    { text: fmtLe(r.ratio_p90_le, r.requests), cls: "num" },
    histBars(r.histogram),
    { text: fmtN(r.overdrafts), cls: "num " + (r.overdrafts ? "bad" : "") },
    { text: fmtN(r.overdraft_tokens), cls: "num" },
  ]));
  const ext = Object.keys(res.extensions || {}).map((k) => k + ": " + res.extensions[k]);
  document.getElementById("reservation-extensions").textContent =
    ext.length ? "leases grown while streaming — " + ext.join(", ") : "";
  fillTable("reservation-pools", res.pools.map((p) => [
    p.pool, { text: fmtN(p.reserved) + " / " + fmtN(p.capacity), cls: "num" }, bar(p.reserved_share),
    { text: fmtN(p.used), cls: "num" }, bar(p.used_share),
    { text: p.kv_feedback ? "limits (KV full)" : "as configured", cls: p.kv_feedback ? "bad" : "good" },
  ]));
  fillTable("learned", (res.learned || []).slice(0, 10).map((x) => [
    x.tenant, x.class, { text: String(x.prompt_bucket), cls: "num" },
    { text: fmtN(x.weight), cls: "num" }, { text: fmtN(x.estimate), cls: "num" },
  ]));
  const limits = st.limits || { quotas: [], shadow: [] };
  fillTable("quotas", (limits.quotas || []).map((q) => {
    const held = (q.used || 0) + (q.reserved || 0);
    const share = q.limit ? held / q.limit : 0;
    const n = q.unit === "cost" ? (v) => v.toFixed(2) : fmtN;
    return [
      q.tenant, q.name, (q.rolling ? "rolling " : "") + q.window,
      { text: n(held) + " / " + n(q.limit) + " " + q.unit, cls: "num " + (q.enforce && share >= 1 ? "bad" : "") },
      bar(Math.min(share, 1)),
      { text: q.enforce ? "yes" : "shadow", cls: q.enforce ? "" : "hint" },
    ];
  }));
  fillTable("shadow", (limits.shadow || []).map((x) => [
    x.kind, x.name, { text: (x.unit === "cost" ? x.limit.toFixed(2) : fmtN(x.limit)) + " " + x.unit, cls: "num" },
    { text: fmtN(x.would_refuse), cls: "num " + (x.would_refuse ? "bad" : "") },
  ]));
  fillTable("shape", (st.shape || []).map((s) => [
    s.pool, { text: fmtN(s.median_cost), cls: "num" }, { text: fmtN(s.max_cost), cls: "num" },
    { text: s.ratio === null ? "–" : s.ratio.toFixed(1) + "×", cls: "num" },
    { text: s.advice_words, cls: s.advice > 0 ? "bad" : "good" },
  ]));

  document.getElementById("meta").textContent =
    "window " + st.window_s + " s · up " + Math.round(st.uptime_s) + " s · updated " + new Date().toLocaleTimeString();
}

// With admin tokens configured, /stats needs one: open the page as /dashboard#token=<read token>
// (a fragment never leaves the browser, so the token is not in any server log).
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
const AUTH = TOKEN ? { authorization: "Bearer " + TOKEN } : {};

async function poll() {
  const dot = document.getElementById("status");
  try {
    const r = await fetch("/stats", { cache: "no-store", headers: AUTH });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    dot.className = "dot live";
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
  } catch (e) {
    dot.className = "dot down";
    document.getElementById("meta").textContent = "cannot read /stats: " + e.message;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
