// The live dashboard: polls /metrics (and /doctor) once a second and draws what it finds. A
// server shows its engine's numbers; a router (kvserve_router: metrics) its own.

import { apiFetch, clearStatus, showStatus } from "./api.js";
import { barChart, formatNumber, formatSeconds, lineChart } from "./charts.js";
import { activeLabel, histogram, parseMetrics, quantileBound, total } from "./metrics.js";

const POLL_MS = 1000;
const DOCTOR_EVERY = 5; // polls between /doctor calls
const HISTORY = 120; // points of the tokens/s line

const history = [];
let previous = null; // {time, counter} of the last poll, for rates
let polls = 0;
let hasDoctor = true; // until /doctor answers 404 (a server without the route, or a router)

const show = (id, text) => { document.getElementById(id).textContent = text; };
const percent = (part, whole) => (whole ? `${formatNumber((100 * part) / whole)}%` : "n/a");

function rate(counter) {
  const now = performance.now();
  const value = previous && counter !== null && counter >= previous.counter
    ? ((counter - previous.counter) * 1000) / (now - previous.time) : null;
  previous = counter === null ? null : { time: now, counter };
  return value;
}

function drawRate(perSecond, caption) {
  if (perSecond !== null) history.push(perSecond);
  if (history.length > HISTORY) history.shift();
  show("tps-caption", caption);
  lineChart(document.getElementById("tps-chart"), history, HISTORY);
}

function drawHistogram(samples, name, id, title) {
  const buckets = histogram(samples, name);
  const count = buckets.reduce((sum, b) => sum + b.count, 0);
  const p50 = formatSeconds(quantileBound(buckets, 0.5));
  const p90 = formatSeconds(quantileBound(buckets, 0.9));
  show(`${id}-caption`, `${title}: ${count} samples since start` +
       (count ? `, p50 \u2264 ${p50}, p90 \u2264 ${p90}` : ""));
  // up to the bucket after the last one in use: the bars stay wide enough to read
  const last = buckets.findLastIndex((b) => b.count > 0);
  const shown = buckets.slice(0, Math.max(8, last + 2));
  barChart(document.getElementById(`${id}-chart`), shown, formatSeconds);
}

function renderEngine(samples) {
  const kvUsed = total(samples, "kvserve:kv_cache_usage_perc");
  const tokens = total(samples, "kvserve:generation_tokens_total");
  const perSecond = rate(tokens);
  show("m-running", formatNumber(total(samples, "kvserve:num_requests_running")));
  show("m-waiting", formatNumber(total(samples, "kvserve:num_requests_waiting")));
  show("m-kv", kvUsed === null ? "n/a" : `${formatNumber(100 * kvUsed)}%`);
  show("m-prefix", percent(total(samples, "kvserve:prefix_cache_hits_total"),
                           total(samples, "kvserve:prefix_cache_queries_total")));
  show("m-tps", formatNumber(perSecond));
  show("m-tokens", formatNumber(tokens));
  show("m-requests", formatNumber(total(samples, "kvserve:request_success_total") ?? 0));
  show("m-regime", activeLabel(samples, "kvserve:bottleneck_regime", "regime") ?? "n/a");
  drawRate(perSecond, "generated tokens/s (last 2 minutes)");
  drawHistogram(samples, "kvserve:time_to_first_token_seconds", "ttft", "time to first token");
  drawHistogram(samples, "kvserve:inter_token_latency_seconds", "itl", "inter-token latency");
}

function renderRouter(samples) {
  const healthy = samples.get("kvserve_router:replica_healthy") || [];
  const routed = total(samples, "kvserve_router:requests_total") ?? 0;
  const perSecond = rate(routed);
  show("r-healthy", `${healthy.filter((s) => s.value === 1).length} of ${healthy.length}`);
  show("r-requests", formatNumber(routed));
  show("r-rps", formatNumber(perSecond));
  show("r-failures", formatNumber(total(samples, "kvserve_router:replica_failures_total") ?? 0));
  drawRate(perSecond, "requests routed/s (last 2 minutes)");
}

async function pollMetrics() {
  const text = await (await apiFetch("metrics")).text();
  const isRouter = text.includes("kvserve_router:");
  document.getElementById("engine-tiles").hidden = isRouter;
  document.getElementById("router-tiles").hidden = !isRouter;
  for (const id of ["ttft", "itl"]) {
    document.getElementById(`${id}-chart`).parentElement.hidden = isRouter;
  }
  (isRouter ? renderRouter : renderEngine)(parseMetrics(text));
}

// the bottleneck doctor's words, where the server has a /doctor route
async function pollDoctor() {
  const doctor = document.getElementById("doctor");
  try {
    const report = await (await apiFetch("doctor")).json();
    doctor.textContent = `Doctor (${report.regime ?? "n/a"}): ${report.summary ?? ""}`;
    doctor.hidden = false;
  } catch (error) {
    doctor.hidden = true;
    hasDoctor = error.status !== 404;
  }
}

async function poll() {
  try {
    await pollMetrics();
    clearStatus("metrics");
  } catch (error) {
    if (error.status !== 401) showStatus(`metrics: ${error.message}`, "metrics");
  }
  if (hasDoctor && polls++ % DOCTOR_EVERY === 0) await pollDoctor();
  setTimeout(poll, POLL_MS);
}

// after a key is entered: the next poll asks /doctor too
export function refreshDashboard() {
  polls = 0;
  hasDoctor = true;
}

export function startDashboard() {
  poll();
}
