// The console's pages that move: reward curves (Plotly, served by the console itself), the
// sample inspector, a running trial's curve growing live, new model versions appearing, and the
// comparison chart. Everything is read from the console's own origin.
"use strict";

const COLORS = ["#1a73e8", "#d93025", "#188038", "#f29900", "#9334e6", "#007b83", "#b06000", "#5f6368"];

function readJson(id) {
  const element = document.getElementById(id);
  return element ? JSON.parse(element.textContent) : null;
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// ---- a trial's reward curves ----

function rewardTraces(curves) {
  const traces = [];
  curves.forEach((curve, index) => {
    const color = COLORS[index % COLORS.length];
    traces.push({ x: curve.ticks, y: curve.returns, name: `${curve.actor} return`, mode: "lines", line: { color } });
    // Reward per tick: per bucket of ticks, the band between its smallest and largest reward.
    traces.push({ x: curve.ticks, y: curve.reward_min, name: `${curve.actor} reward (min)`, mode: "lines", yaxis: "y2", line: { color, width: 1, dash: "dot" }, showlegend: false });
    traces.push({ x: curve.ticks, y: curve.reward_max, name: `${curve.actor} reward`, mode: "lines", yaxis: "y2", fill: "tonexty", line: { color, width: 1, dash: "dot" } });
  });
  return traces;
}

function drawTrial() {
  const chart = document.getElementById("reward-chart");
  if (!chart) return;
  const curves = readJson("curves-data");
  const layout = {
    margin: { t: 20, r: 60, b: 40, l: 60 },
    xaxis: { title: { text: "tick" } },
    yaxis: { title: { text: "cumulative return" } },
    yaxis2: { title: { text: "reward per tick (min–max per bucket)" }, overlaying: "y", side: "right" },
    legend: { orientation: "h" },
  };
  Plotly.newPlot(chart, rewardTraces(curves), layout, { responsive: true, displaylogo: false });
  chart.dataset.points = String(curves.length ? curves[0].ticks.length : 0);
  if (chart.dataset.running === "true") followTrial(chart, curves);
}

function followTrial(chart, curves) {
  const trialId = chart.dataset.trial;
  const totals = curves.map((curve) => curve.total !== undefined ? curve.total : (curve.returns.length ? curve.returns[curve.returns.length - 1] : 0));
  let next = Number(chart.dataset.ticks);
  const source = new EventSource(`/api/trials/${encodeURIComponent(trialId)}/events?from=${next}`);
  source.onmessage = (event) => {
    const batch = JSON.parse(event.data);
    if (batch.state) document.getElementById("trial-state").textContent = batch.state;
    if (!batch.ticks.length) return;
    const xs = [], ys = [], indices = [];
    curves.forEach((curve, index) => {
      const rewards = batch.rewards[curve.actor] || batch.ticks.map(() => 0);
      const returns = rewards.map((reward) => (totals[index] += reward));
      xs.push(batch.ticks, batch.ticks, batch.ticks);
      ys.push(returns, rewards, rewards);
      indices.push(3 * index, 3 * index + 1, 3 * index + 2);
    });
    Plotly.extendTraces(chart, { x: xs, y: ys }, indices);
    next = batch.ticks[batch.ticks.length - 1] + 1;
    chart.dataset.ticks = String(next);
    chart.dataset.points = String(Number(chart.dataset.points) + batch.ticks.length);
    const input = document.getElementById("tick-number");
    if (input) input.max = String(next - 1);
  };
  source.addEventListener("end", () => source.close());
  source.addEventListener("failure", (event) => { source.close(); showChartError(chart, JSON.parse(event.data)); });
}

function showChartError(chart, message) {
  const note = document.createElement("p");
  note.className = "error";
  note.textContent = `Live updates stopped: ${message}`;
  chart.after(note);
}

// ---- the sample inspector ----

function payloadHtml(payload) {
  if (!payload) return "—";
  if (payload.decoded) return `<code>${escapeHtml(payload.decoded)}</code>`;
  return `<span class="payload">${payload.size} bytes <small><code>${escapeHtml(payload.preview)}</code></small></span>`;
}

function number(value) {
  return Number(value.toPrecision(6));  // rewards are float32: 0.51, not 0.5099999904632568
}

function tickHtml(view) {
  const rows = view.actors.map((actor) => {
    const rewards = actor.rewards.map((r) => `${number(r.value)} from ${escapeHtml(r.sender)} (confidence ${number(r.confidence)})`).join("<br>") || "—";
    const messages = actor.messages.map((m) => `${escapeHtml(m.sender)}: ${payloadHtml(m.payload)}`).join("<br>") || "—";
    return `<tr data-actor="${escapeHtml(actor.actor)}"><td>${escapeHtml(actor.actor)}</td><td>${payloadHtml(actor.observation)}</td>` +
      `<td>${payloadHtml(actor.action)}</td><td>${actor.reward === null ? "—" : number(actor.reward)}</td><td>${rewards}</td><td>${messages}</td></tr>`;
  }).join("");
  return `<p>Tick <strong id="shown-tick">${view.tick}</strong>, state ${escapeHtml(view.state)}, timestamp ${view.timestamp}</p>` +
    `<table><thead><tr><th>actor</th><th>observation</th><th>action</th><th>reward</th><th>rewards received</th><th>messages received</th></tr></thead><tbody>${rows}</tbody></table>`;
}

function setUpInspector() {
  const inspector = document.getElementById("inspector");
  if (!inspector || Number(inspector.dataset.ticks) === 0) return;
  const trialId = inspector.dataset.trial;
  const input = document.getElementById("tick-number");
  const view = document.getElementById("tick-view");
  async function show(tick) {
    const last = Number(input.max);
    tick = Math.max(0, Math.min(last, tick));
    input.value = String(tick);
    const response = await fetch(`/api/trials/${encodeURIComponent(trialId)}/ticks/${tick}`);
    const body = await response.json();
    view.innerHTML = response.ok ? tickHtml(body) : `<p class="error">${escapeHtml(body.message)}</p>`;
  }
  document.getElementById("tick-first").onclick = () => show(0);
  document.getElementById("tick-previous").onclick = () => show(Number(input.value) - 1);
  document.getElementById("tick-next").onclick = () => show(Number(input.value) + 1);
  document.getElementById("tick-last").onclick = () => show(Number(input.max));
  input.onchange = () => show(Number(input.value));
  show(0);
}

// ---- models: new versions appear ----

function followVersions() {
  const table = document.getElementById("versions");
  if (!table) return;
  const model = table.dataset.model;
  const body = table.querySelector("tbody");
  const source = new EventSource(`/api/models/${encodeURIComponent(model)}/events`);
  source.onmessage = (event) => {
    const version = JSON.parse(event.data);
    if (body.querySelector(`tr[data-version="${version.number}"]`)) return;
    const userData = Object.entries(version.user_data).map(([k, v]) => `<code>${escapeHtml(k)}=${escapeHtml(v)}</code>`).join(" ");
    const row = document.createElement("tr");
    row.dataset.version = String(version.number);
    row.innerHTML = `<td>${version.number}</td><td>${escapeHtml(version.created)}</td><td>${version.size}</td>` +
      `<td><code class="hash">${version.sha256}</code></td><td>${version.archived ? "archived" : "transient"}</td><td>${userData}</td>` +
      `<td><a class="download" href="/models/${encodeURIComponent(model)}/versions/${version.number}/data">download</a></td>`;
    body.prepend(row);
  };
  source.addEventListener("failure", () => source.close());
}

// ---- comparison ----

function drawComparison() {
  const chart = document.getElementById("compare-chart");
  if (!chart) return;
  const series = readJson("compare-data");
  const traces = series.map((one, index) => ({ x: one.ticks, y: one.returns, name: one.name, mode: "lines", line: { color: COLORS[index % COLORS.length] } }));
  Plotly.newPlot(chart, traces, { margin: { t: 20 }, xaxis: { title: { text: "tick" } }, yaxis: { title: { text: "cumulative return" } } }, { responsive: true, displaylogo: false });
}

document.addEventListener("DOMContentLoaded", () => {
  drawTrial();
  setUpInspector();
  followVersions();
  drawComparison();
});
