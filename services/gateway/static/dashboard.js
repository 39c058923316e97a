// The Weir dashboard: polls /dashboard/data every 2 s with the admin token and fills the panels.
// The token comes from the URL fragment (#token=..., never sent to a server) or the form, and is kept
// in sessionStorage only. Every string from the data goes in with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const KEEP_POINTS = 150; // 5 minutes of history in the charts
const TOKEN_KEY = "weir.dashboard.token";
const points = { t: [], tps: [], p50: [], p95: [], p99: [] };
const charts = {};

function takeToken() {
  const match = /(?:^|&)token=([^&]*)/.exec(location.hash.slice(1));
  if (match) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function num(value, digits) {
  if (value === null || value === undefined) return "–";
  return Number(value).toFixed(digits === undefined ? 3 : digits);
}

function table(panel, selector, head, rows) {
  const node = document.querySelector(`[data-panel="${panel}"] ${selector}`);
  node.replaceChildren(el("tr", {}, ...head.map((h) => el("th", {}, h))), ...rows);
}

// A name that may break after its separators when a column is narrow (a <wbr> adds no text: copying gives the name).
function breakable(text) {
  const parts = String(text).split(/(?<=[.@\-/_])/);
  const node = el("span", {});
  parts.forEach((part, i) => node.append(...(i ? [el("wbr", {}), part] : [part])));
  return node;
}

function cell(value, cls) {
  const isName = typeof value === "string" && !(cls || "").split(" ").includes("num");
  return el("td", cls ? { class: cls } : {}, isName ? breakable(value) : value);
}

function setState(panel, state, message) {
  const node = document.querySelector(`[data-panel="${panel}"]`);
  node.dataset.state = state;
  node.querySelector(".empty").textContent = message || "no data yet";
}

function chart(id, labels, colors) {
  if (charts[id] || typeof uPlot === "undefined") return charts[id];
  const target = document.getElementById(id);
  const series = [{}, ...labels.map((label, i) => ({ label, stroke: colors[i], width: 2, spanGaps: true }))];
  charts[id] = new uPlot({
    width: Math.max(target.clientWidth, 300), height: 160, series, legend: { live: false },
    axes: [{ stroke: "#8a96a3", grid: { stroke: "#2c3844" } }, { stroke: "#8a96a3", grid: { stroke: "#2c3844" } }],
  }, [[], ...labels.map(() => [])], target);
  return charts[id];
}

function remember(data) {
  // The gateway's TTFT (its streamed and plain requests); with none in the window (batch jobs only), the workers'.
  const pick = (key) => data.latency && data.latency[key] && data.latency[key].all.count ? data.latency[key].all : null;
  const all = pick("ttft") || pick("worker_ttft");
  points.t.push(data.now_ms / 1000);
  points.tps.push(data.throughput ? data.throughput.tokens_per_s : null);
  for (const q of ["p50", "p95", "p99"]) points[q].push(all ? all[q] : null);
  for (const key of Object.keys(points)) if (points[key].length > KEEP_POINTS) points[key].shift();
}

function showThroughput(data) {
  if (!data.throughput) return setState("throughput", "empty", "no data yet: no token counter on this gateway");
  document.querySelector('[data-field="tokens_per_s"]').textContent = num(data.throughput.tokens_per_s, 1);
  const rows = Object.entries(data.throughput.by_model).map(([model, tps]) =>
    el("tr", {}, cell(model || "(none)"), cell(num(tps, 1), "num")));
  table("throughput", "table.rows", ["model", "tokens/s"], rows);
  setState("throughput", "ok");
  const plot = chart("chart-throughput", ["tokens/s"], ["#4caf50"]);
  if (plot) plot.setData([points.t, points.tps]);
}

function showLatency(data) {
  const kinds = { ttft: "time to first token", itl: "inter-token", e2e: "end to end",
    worker_ttft: "TTFT at the workers (all, batch too)", worker_itl: "inter-token at the workers" };
  const rows = [];
  for (const [kind, title] of Object.entries(kinds)) {
    const found = data.latency && data.latency[kind];
    if (!found || !found.all.count) continue;
    for (const [model, q] of [["all", found.all], ...Object.entries(found.by_model)]) {
      if (!q.count) continue;
      rows.push(el("tr", { "data-kind": kind }, cell(title), cell(model), cell(num(q.p50), "num"),
        cell(num(q.p95), "num"), cell(num(q.p99), "num"), cell(num(q.count, 0), "num")));
    }
  }
  if (!rows.length) return setState("latency", "empty", "no data yet: no request finished in the window");
  table("latency", "table.rows", ["", "model", "p50", "p95", "p99", "n"], rows);
  setState("latency", "ok");
  const plot = chart("chart-latency", ["TTFT p50", "TTFT p95", "TTFT p99"], ["#4caf50", "#ffb300", "#ef5350"]);
  if (plot) plot.setData([points.t, points.p50, points.p95, points.p99]);
}

function showQueue(data) {
  const rows = data.workers.map((w) => el("tr", {}, cell(w.worker_id), cell(w.num_running, "num"),
    cell(w.num_waiting, "num"), cell(w.max_num_seqs, "num")));
  const lag = (data.lag || []).map((l) => el("tr", {}, cell(l.consumergroup), cell(l.topic), cell(num(l.lag, 0), "num")));
  if (!rows.length && !lag.length) return setState("queue", "empty", "no data yet: no live worker, no lag reported");
  table("queue", "table.rows", ["worker", "running", "waiting", "max"], rows);
  table("queue", "table.lag", ["consumer group", "topic", "lag"], lag);
  setState("queue", "ok");
}

function percent(value) {
  if (value === null || value === undefined) return "–";
  return el("span", {}, el("span", { class: "bar", style: `width:${Math.round(value * 60)}px` }), `${(value * 100).toFixed(1)}%`);
}

function showKv(data) {
  const rows = data.workers.map((w) => el("tr", {}, cell(w.worker_id), cell(percent(w.kv_cache_usage_perc), "num"),
    cell(percent(w.prefix_cache_hit_rate), "num"), cell(w.prefix_cache_queries, "num")));
  if (!rows.length) return setState("kv", "empty", "no data yet: no live worker");
  table("kv", "table.rows", ["worker", "KV used", "prefix hits", "tokens looked up"], rows);
  setState("kv", "ok");
}

// The output SLA of a version's latest structured / determinism alert ("–": none yet; the auditor's /metrics is live).
function slaCells(sla) {
  const s = sla && sla.structured, d = sla && sla.determinism;
  const structured = s ? `${(s.rate * 100).toFixed(1)}% (${s.valid}/${s.valid + s.invalid})` : "–";
  const determinism = d ? `${d.same} / ${d.differs}` : "–";
  return [cell(structured, s ? `num state-${s.state}` : "num"), cell(determinism, d ? `num state-${d.state}` : "num")];
}

function showVersions(data) {
  const open = {};
  for (const alert of data.alerts.open) (open[alert.model_version] = open[alert.model_version] || []).push(alert.signal);
  const sla = data.alerts.sla || {};
  const rows = data.versions.map((v) => {
    const sid = `${v.name}@${v.version}`;
    const health = open[sid] ? `alert: ${open[sid].join(", ")}` : "ok";
    return el("tr", {}, cell(sid + (v.default ? " (default)" : "")), cell(v.state, `state-${v.state}`),
      cell(v.desired), cell(Object.keys(v.workers).length, "num"), cell(health, open[sid] ? "state-raised" : "state-ready"),
      ...slaCells(sla[sid]));
  });
  if (!rows.length) return setState("versions", "empty", "no data yet: no model version known");
  table("versions", "table.rows", ["version", "state", "desired", "workers", "health", "structured valid",
    "determinism same / differs"], rows);
  setState("versions", "ok");
}

function showTenants(data) {
  const rows = data.tenants.top.map((t) => el("tr", {}, cell(t.tenant), cell(t.tokens, "num"), cell(t.requests, "num"),
    cell(t.cost_usd === null ? "–" : `$${num(t.cost_usd, 4)}${t.unpriced ? "+" : ""}`, "num")));
  if (!rows.length) return setState("tenants", "empty", `no data yet: no usage on ${data.tenants.day}`);
  table("tenants", "table.rows", ["tenant", "tokens", "requests", "cost"], rows);
  setState("tenants", "ok");
}

function showAlerts(data) {
  const when = (ms) => new Date(ms).toISOString().slice(11, 19);
  const row = (a, open) => el("tr", {}, cell(when(a.created_ms)), cell(a.model_version), cell(a.signal),
    cell(open ? "open" : a.state, `state-${a.state}`), cell(num(a.value)), cell(num(a.threshold)), cell(a.detail, "detail"));
  const rows = [...data.alerts.open.map((a) => row(a, true)), ...data.alerts.recent.map((a) => row(a, false))];
  if (!rows.length) return setState("alerts", "empty", "no alerts");
  table("alerts", "table.rows", ["time", "version", "signal", "state", "value", "threshold", "detail"], rows);
  setState("alerts", "ok");
}

const PANELS = [showThroughput, showLatency, showQueue, showKv, showVersions, showTenants, showAlerts];

function status(state, text) {
  const node = document.getElementById("status");
  node.dataset.state = state;
  node.textContent = text;
}

async function poll() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return askToken();
  let response;
  try {
    response = await fetch("/dashboard/data", { headers: { authorization: `Bearer ${token}` }, cache: "no-store" });
  } catch (err) {
    status("error", `gateway unreachable: ${err}`);
    return;
  }
  if (response.status === 401 || response.status === 403) {
    sessionStorage.removeItem(TOKEN_KEY);
    status("error", "the admin token was refused");
    return askToken();
  }
  if (!response.ok) return status("error", `/dashboard/data answered ${response.status}`);
  const data = await response.json();
  remember(data);
  for (const show of PANELS) {
    try {
      show(data);
    } catch (err) {
      setState(show.name.replace(/^show/, "").toLowerCase(), "error", `cannot show: ${err}`);
    }
  }
  status("ok", `updated ${new Date(data.now_ms).toISOString().slice(11, 19)} UTC` +
    (data.window_s ? `, window ${Math.round(data.window_s)} s` : ""));
}

function askToken() {
  document.getElementById("login").hidden = false;
  document.getElementById("logout").hidden = true;
}

function start() {
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value);
    document.getElementById("login").hidden = true;
    document.getElementById("logout").hidden = false;
    poll();
  });
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    askToken();
  });
  if (takeToken()) document.getElementById("logout").hidden = false;
  poll();
  setInterval(poll, POLL_MS);
}

start();
