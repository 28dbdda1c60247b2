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

const REWARD_LAYOUT = {
  margin: { t: 20, r: 60, b: 40, l: 60 },
  xaxis: { title: { text: "tick" } },
  yaxis: { title: { text: "cumulative return" } },
  yaxis2: { title: { text: "reward per tick (min–max per bucket)" }, overlaying: "y", side: "right" },
  legend: { orientation: "h" },
};

function returnsText(returns) {
  const entries = Object.entries(returns).sort(([a], [b]) => a.localeCompare(b));
  return entries.map(([actorClass, value]) => `${escapeHtml(actorClass)} ${number(value)}`).join(", ") || "none";
}

// The curves come as snapshots while the trial's rewards are read (a long trial takes a while),
// then while it runs: each one replaces the chart's data.
function drawTrial() {
  const chart = document.getElementById("reward-chart");
  if (!chart) return;
  const status = document.getElementById("curve-status");
  Plotly.newPlot(chart, [], REWARD_LAYOUT, { responsive: true, displaylogo: false });
  const source = new EventSource(`/api/trials/${encodeURIComponent(chart.dataset.trial)}/curves`);
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    Plotly.react(chart, rewardTraces(snapshot.curves), REWARD_LAYOUT);
    chart.dataset.points = String(snapshot.curves.length ? snapshot.curves[0].ticks.length : 0);
    chart.dataset.ticks = String(snapshot.ticks);
    document.getElementById("trial-state").textContent = snapshot.state;
    document.getElementById("trial-returns").innerHTML = returnsText(snapshot.returns);
    status.textContent = snapshot.done ? `${snapshot.ticks} ticks.` : `${snapshot.ticks} ticks so far…`;
    const input = document.getElementById("tick-number");
    if (input && snapshot.ticks > 0) {
      // The samples include late ones: the last tick is only known from the curves.
      input.max = String(snapshot.ticks - 1);
      document.getElementById("tick-last").disabled = false;
    }
  };
  source.addEventListener("end", () => source.close());
  source.addEventListener("failure", (event) => { source.close(); status.textContent = `Stopped: ${JSON.parse(event.data)}`; status.className = "error"; });
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
