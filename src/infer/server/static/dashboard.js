// infer's live view: one event per poll from /dashboard/events, or the lines of a recorded trace.
// Each event carries the step records since the last one and a snapshot of the queues and KV
// blocks (see src/infer/engine/trace.py); the page keeps the last MAX_STEPS steps for the timeline.
"use strict";

const MAX_STEPS = 300;
const MAX_LATENCY_POINTS = 240;
const MAX_ROWS = 40;
// Two updates a second: on a small machine the browser's own rendering competes with the engine.
const LIVE_INTERVAL_S = 0.5;
const $ = (id) => document.getElementById(id);
const apiKey = new URLSearchParams(location.search).get("api_key");
// Behind the replicas' router: ?replica=NAME shows that replica's view (each shows its role).
const replica = new URLSearchParams(location.search).get("replica");

// ---- colours -------------------------------------------------------------------------------
function hueOf(text) {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  // A final mix, so ids that differ in one character get far-apart hues.
  h = Math.imul(h ^ (h >>> 16), 2246822507);
  h = Math.imul(h ^ (h >>> 13), 3266489909);
  return ((h ^ (h >>> 16)) >>> 0) % 360;
}
const requestColour = (rid) => `hsl(${hueOf(rid)}, 65%, 48%)`;
const css = getComputedStyle(document.documentElement);
const FREE = css.getPropertyValue("--free").trim();
const CACHED = css.getPropertyValue("--cached").trim();

// ---- the step timeline ---------------------------------------------------------------------
const steps = { x: [], total: [], prefill: [], budget: [], ms: [], preempt: [], swap: [] };
let totalPreemptions = 0;

function pushStep(rec) {
  const s = steps;
  s.x.push(rec.step);
  s.prefill.push(rec.num_prefill_tokens);
  s.total.push(rec.num_prefill_tokens + rec.num_decode_tokens);
  s.budget.push(rec.token_budget);
  s.ms.push(rec.duration_ms);
  s.preempt.push(rec.preempted.length ? rec.token_budget : null);
  const swapped = rec.swapped_out_blocks + rec.swapped_in_blocks;
  s.swap.push(swapped ? rec.token_budget * 0.92 : null);
  if (s.x.length > MAX_STEPS) for (const k in s) s[k].shift();
  totalPreemptions += rec.preempted.length;
  if (rec.preempted.length) logEvent("preempt", `step ${rec.step}: preempted ${rec.preempted.join(", ")}`);
  if (swapped) logEvent("swap", `step ${rec.step}: swapped out ${rec.swapped_out_blocks}, in ${rec.swapped_in_blocks} blocks`);
}

function clearSteps() {
  for (const k in steps) steps[k].length = 0;
  totalPreemptions = 0;
  $("events").replaceChildren();
}

function makeTimeline() {
  const el = $("timeline");
  const bars = uPlot.paths.bars({ size: [0.85, 30] });
  const opts = {
    width: el.clientWidth || 700, height: 260,
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: false }, tok: { range: (u, lo, hi) => [0, Math.max(hi, 1)] }, ms: {} },
    axes: [
      { label: "step" },
      { scale: "tok", label: "tokens" },
      { scale: "ms", side: 1, label: "step ms", grid: { show: false } },
    ],
    series: [
      { label: "step" },
      { label: "decode", scale: "tok", fill: "#2a9d8f", stroke: "#2a9d8f", paths: bars, points: { show: false },
        value: (u, v, si, i) => (v == null || i == null ? "" : v - u.data[2][i]) },
      { label: "prefill", scale: "tok", fill: "#457b9d", stroke: "#457b9d", paths: bars, points: { show: false } },
      { label: "budget", scale: "tok", stroke: "#6b7380", dash: [6, 4], width: 1, points: { show: false } },
      { label: "step ms", scale: "ms", stroke: "#e9a23b", width: 1.5, points: { show: false } },
      { label: "preempted", scale: "tok", stroke: "#c1121f", fill: "#c1121f", paths: () => null,
        points: { show: true, size: 10, fill: "#c1121f" } },
      { label: "swap", scale: "tok", stroke: "#bc6c25", fill: "#bc6c25", paths: () => null,
        points: { show: true, size: 8, fill: "#bc6c25" } },
    ],
  };
  return new uPlot(opts, [[], [], [], [], [], [], []], el);
}

// ---- latency and throughput ----------------------------------------------------------------
const lat = { t: [], ttft50: [], ttft99: [], itl50: [], itl99: [], tps: [] };
const t0 = performance.now();

function makeLatency() {
  const el = $("latency");
  return new uPlot({
    width: el.clientWidth || 500, height: 260,
    scales: { x: { time: false }, ms: {}, tps: {} },
    axes: [{ label: "seconds" }, { scale: "ms", label: "ms" },
           { scale: "tps", side: 1, label: "out tok/s", grid: { show: false } }],
    series: [
      { label: "t" },
      { label: "TTFT p50", scale: "ms", stroke: "#457b9d", width: 1.5 },
      { label: "TTFT p99", scale: "ms", stroke: "#457b9d", dash: [5, 3] },
      { label: "ITL p50", scale: "ms", stroke: "#e76f51", width: 1.5 },
      { label: "ITL p99", scale: "ms", stroke: "#e76f51", dash: [5, 3] },
      { label: "out tok/s", scale: "tps", stroke: "#2a9d8f", width: 2 },
    ],
  }, [[], [], [], [], [], []], el);
}

function pushLatency(ev) {
  const l = ev.latency;
  lat.t.push((performance.now() - t0) / 1000);
  lat.ttft50.push(l.ttft_ms.p50); lat.ttft99.push(l.ttft_ms.p99);
  lat.itl50.push(l.itl_ms.p50); lat.itl99.push(l.itl_ms.p99);
  lat.tps.push(ev.throughput.generation_tok_s);
  if (lat.t.length > MAX_LATENCY_POINTS) for (const k in lat) lat[k].shift();
  $("latency-caption").textContent =
    `${l.num_finished} requests finished in the last ${l.window_s}s` +
    (l.ttft_ms.p50 == null ? "" : ` · TTFT p50 ${l.ttft_ms.p50.toFixed(0)} ms · ITL p50 ${l.itl_ms.p50.toFixed(1)} ms`);
}

// ---- the KV block map ----------------------------------------------------------------------
function drawBlocks(snap) {
  const canvas = $("blocks");
  const ctx = canvas.getContext("2d");
  const n = snap.blocks.length;
  const W = canvas.width, H = canvas.height;
  // The largest square cell with which every block fits the canvas.
  let cell = Math.max(1, Math.floor(Math.sqrt((W * H) / Math.max(n, 1))));
  while (cell > 1 && Math.ceil(n / Math.floor(W / cell)) * cell > H) cell -= 1;
  const cols = Math.max(1, Math.floor(W / cell));
  const gap = cell >= 6 ? 1 : 0;
  const holders = snap.requests.map((r) => requestColour(r.request_id));
  ctx.clearRect(0, 0, W, H);
  let used = 0, cached = 0;
  for (let i = 0; i < n; i++) {
    const c = snap.blocks[i];
    let colour = FREE;
    if (c === "u") { used++; colour = holders[snap.block_owner[i]] || "#333"; }
    else if (c === "c") { cached++; colour = CACHED; }
    ctx.fillStyle = colour;
    ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
  }
  canvas.dataset.blocks = n;
  canvas.dataset.used = used;
  canvas.dataset.cached = cached;
  $("swapped-blocks").textContent = snap.num_swapped_blocks;
  $("blocks-caption").textContent =
    `${n} blocks of ${snap.block_size} tokens · ${used} held · ${cached} cached · ${n - used - cached} empty`;
}

// ---- the queues ----------------------------------------------------------------------------
function ms(seconds) { return seconds == null ? "—" : `${(1000 * seconds).toFixed(0)} ms`; }

function requestRow(r) {
  const li = document.createElement("li");
  li.className = "req";
  li.dataset.state = r.state;
  const promptDone = Math.min(r.num_computed_tokens, r.num_prompt_tokens);
  const total = r.num_prompt_tokens + (r.max_tokens || Math.max(r.num_output_tokens, 1));
  const pw = (100 * promptDone) / total, ow = (100 * r.num_output_tokens) / total;
  li.innerHTML =
    `<span class="id"></span><span class="prio">prio ${r.priority}</span>` +
    `<div class="bar"><span class="prompt" style="width:${pw}%"></span><span class="out" style="width:${ow}%"></span></div>` +
    `<div class="meta">prompt ${promptDone}/${r.num_prompt_tokens} · out ${r.num_output_tokens}/${r.max_tokens ?? "∞"}` +
    ` · ${r.num_blocks} blocks · TTFT ${ms(r.ttft_s)} · waited ${ms(r.waited_s)}` +
    (r.num_preemptions ? ` · preempted ×${r.num_preemptions}` : "") + `</div>`;
  const id = li.querySelector(".id");
  id.textContent = r.request_id;
  id.style.color = requestColour(r.request_id);
  return li;
}

function fillQueue(id, requests) {
  const ol = $(id);
  const rows = requests.slice(0, MAX_ROWS).map(requestRow);
  if (requests.length > MAX_ROWS) {
    const more = document.createElement("li");
    more.className = "more";
    more.textContent = `+ ${requests.length - MAX_ROWS} more`;
    rows.push(more);
  }
  ol.replaceChildren(...rows);
  $(`${id}-n`).textContent = `(${requests.length})`;
}

function drawQueues(snap) {
  const rs = snap.requests;
  fillQueue("q-running", rs.filter((r) => r.state === "running"));
  // Waiting requests arrive in the policy's order already (priority: most urgent first).
  fillQueue("q-waiting", rs.filter((r) => r.state === "waiting"));
  fillQueue("q-swapped", rs.filter((r) => r.state === "swapped" || r.state === "preempted"));
  $("policy").textContent = `${snap.policy} policy · token budget ${snap.token_budget} · max ${snap.max_num_seqs} sequences`;
}

// ---- one frame -----------------------------------------------------------------------------
function logEvent(kind, text) {
  const ol = $("events");
  const li = document.createElement("li");
  li.className = kind;
  li.textContent = text;
  ol.prepend(li);
  while (ol.children.length > 200) ol.lastChild.remove();
}

function drawSnapshot(snap, stepRecord) {
  const rs = snap.requests;
  $("steps").textContent = snap.step;
  $("num-running").textContent = rs.filter((r) => r.state === "running").length;
  $("num-waiting").textContent = rs.filter((r) => r.state === "waiting").length;
  $("num-swapped").textContent = rs.filter((r) => r.state === "swapped").length;
  $("preemptions").textContent = totalPreemptions;
  $("kv-usage").textContent = `${(100 * snap.kv_usage).toFixed(0)}%`;
  $("prefix-hit").textContent = snap.prefix_cache_queries
    ? `${((100 * snap.prefix_cache_hits) / snap.prefix_cache_queries).toFixed(0)}%` : "—";
  drawBlocks(snap);
  drawQueues(snap);
  timeline.setData([steps.x, steps.total, steps.prefill, steps.budget, steps.ms, steps.preempt, steps.swap]);
}

function setMode(mode, text) {
  const badge = $("mode");
  badge.className = `badge ${mode}`;
  badge.textContent = text;
}

// ---- live ----------------------------------------------------------------------------------
let source = null;

function goLive() {
  stopReplay();
  clearSteps();
  $("replay-controls").hidden = true;
  const q = new URLSearchParams({ interval: String(LIVE_INTERVAL_S) });
  if (apiKey) q.set("api_key", apiKey);
  if (replica) q.set("replica", replica);
  source = new EventSource(`/dashboard/events?${q}`);
  source.onopen = () => setMode("live", "live");
  source.onerror = () => setMode("off", "disconnected (retrying)");
  source.onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    ev.steps.forEach(pushStep);
    if (document.hidden) return;  // a background tab keeps its data but draws nothing
    $("model").textContent = ev.role ? `${ev.model} (${ev.role} replica)` : ev.model;
    $("preemptions").dataset.serverTotal = ev.server.preemptions_total;
    $("gen-tps").textContent = ev.throughput.generation_tok_s.toFixed(0);
    pushLatency(ev);
    latency.setData([lat.t, lat.ttft50, lat.ttft99, lat.itl50, lat.itl99, lat.tps]);
    drawSnapshot(ev.snapshot);
  };
}

// ---- replay of a recorded trace ------------------------------------------------------------
let frames = [], frameIndex = 0, playing = false, timer = null;

function stopReplay() {
  if (timer) clearInterval(timer);
  timer = null;
}

function showFrame(i) {
  frameIndex = Math.max(0, Math.min(i, frames.length - 1));
  clearSteps();
  for (const f of frames.slice(Math.max(0, frameIndex - MAX_STEPS + 1), frameIndex + 1)) pushStep(f.step);
  totalPreemptions = frames.slice(0, frameIndex + 1).reduce((n, f) => n + f.step.preempted.length, 0);
  drawSnapshot(frames[frameIndex].snapshot);
  $("scrub").value = frameIndex;
  setMode("replay", `replay ${frameIndex + 1}/${frames.length}`);
}

function play(on) {
  playing = on;
  $("play").textContent = on ? "pause" : "play";
  stopReplay();
  if (!on) return;
  timer = setInterval(() => {
    if (frameIndex >= frames.length - 1) return play(false);
    showFrame(frameIndex + 1);
  }, 1000 / Number($("speed").value));
}

function openTrace(text) {
  frames = text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
  if (!frames.length) return;
  if (source) { source.close(); source = null; }
  $("replay-controls").hidden = false;
  $("scrub").max = frames.length - 1;
  $("model").textContent = "recorded trace";
  $("latency-caption").textContent = "latency is shown live only";
  $("gen-tps").textContent = "—";
  for (const k in lat) lat[k].length = 0;
  latency.setData([lat.t, lat.ttft50, lat.ttft99, lat.itl50, lat.itl99, lat.tps]);
  showFrame(0);
  play(true);
}

$("trace-file").addEventListener("change", async (e) => {
  const file = e.target.files[0];
  if (file) openTrace(await file.text());
});
$("play").addEventListener("click", () => play(!playing));
$("scrub").addEventListener("input", (e) => { play(false); showFrame(Number(e.target.value)); });
$("speed").addEventListener("change", () => play(playing));
$("live").addEventListener("click", goLive);

const timeline = makeTimeline();
const latency = makeLatency();
window.addEventListener("resize", () => {
  timeline.setSize({ width: $("timeline").clientWidth, height: 260 });
  latency.setSize({ width: $("latency").clientWidth, height: 260 });
});
window.inferDashboard = { openTrace, showFrame };  // for tests and the console
goLive();
