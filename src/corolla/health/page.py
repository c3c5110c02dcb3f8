"""The monitor's web page: static HTML + CSS + JS with no external assets; it polls `api/v1/state` and renders
everything from that JSON, so the page and the API never disagree."""

from __future__ import annotations

PAGE_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>corolla swarm health</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1d2430; background: #fafbfc; }
  h1 { font-size: 1.4rem; margin: 0 0 .3rem; }
  h2 { font-size: 1.15rem; margin: 1.6rem 0 .4rem; }
  .meta { color: #5b6573; font-size: .85rem; }
  .badge { display: inline-block; padding: .05rem .5rem; border-radius: .6rem; font-size: .8rem; color: #fff; }
  .badge.healthy { background: #2e9d48; } .badge.broken { background: #d1342f; }
  .coverage { display: flex; gap: 1px; height: 2.2rem; margin: .4rem 0; max-width: 100%; }
  .block { flex: 1 1 0; min-width: 3px; display: flex; align-items: center; justify-content: center;
           font-size: .7rem; color: #fff; border-radius: 2px; }
  .block.online { background: #2e9d48; } .block.online.s1 { background: #7cc48a; color: #1d2430; }
  .block.joining { background: #e2a720; } .block.gap { background: #d1342f; }
  .legend span { margin-right: 1rem; font-size: .8rem; }
  .legend i { display: inline-block; width: .8rem; height: .8rem; margin-right: .3rem; vertical-align: -1px; }
  table { border-collapse: collapse; font-size: .8rem; margin-top: .5rem; max-width: 100%; }
  th, td { border-bottom: 1px solid #dde2e8; padding: .2rem .35rem; text-align: left; white-space: nowrap; }
  td.num, th.num { text-align: right; }
  td.pings { max-width: 10rem; overflow: hidden; text-overflow: ellipsis; }
  .flow { font-size: .85rem; margin: .3rem 0; } .flow b { font-weight: 600; }
  th { background: #eef1f4; white-space: normal; vertical-align: bottom; }
  td.state-online { color: #2e9d48; } td.state-joining { color: #b57f00; }
  td.state-offline, td.state-unreachable { color: #d1342f; }
  .spanbar { display: inline-flex; vertical-align: middle; width: 6rem; height: .6rem; background: #e6e9ed; }
  .spanbar div { height: 100%; } .spanbar .on { background: #2e9d48; }
  .mono { font-family: ui-monospace, monospace; }
  #error { color: #d1342f; }
</style>
</head>
<body>
<h1>corolla swarm health</h1>
<div class="meta">updated <span id="updated">never</span> &middot; refresh every <span id="period">?</span> s
  &middot; bootstrap peers: <span id="bootstrap">?</span> &middot; <a href="api/v1/state">JSON</a>
  <span id="error"></span></div>
<div class="legend meta" style="margin-top:.5rem">
  <span><i style="background:#2e9d48"></i>served (darker: 2+ servers)</span>
  <span><i style="background:#e2a720"></i>only joining servers</span>
  <span><i style="background:#d1342f"></i>gap: no online server</span>
</div>
<div id="models"><p class="meta">loading&hellip;</p></div>
<div id="issues"></div>
<script>
"use strict";
// [header, numeric]; version, dtype, quantization, adapters, relay and forward/network rps: the peer cell's tooltip
const COLUMNS = [["Name", 0], ["Peer ID", 0], ["Blocks", 0], ["State", 0], ["Capacity tok/s", 1], ["Sessions", 1],
  ["Busy", 1], ["Served tok/s", 1], ["Tokens served", 1], ["Moves", 1], ["Inference rps", 1], ["Cache / block", 1],
  ["Next pings", 0]];

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function num(x, digits) { return (x === null || x === undefined) ? "" : Number(x).toFixed(digits); }

function coverageBar(report) {
  const bar = el("div", {"class": "coverage", "data-testid": "coverage"});
  for (const b of report.blocks) {
    const cls = "block " + b.state + (b.state === "online" && b.num_servers === 1 ? " s1" : "");
    const title = "block " + b.index + ": " + b.num_servers + " server(s), " + num(b.throughput, 1) + " tok/s";
    bar.appendChild(el("div", {"class": cls, "data-index": b.index, "data-servers": b.num_servers,
                               "title": title}, report.blocks.length <= 64 ? b.num_servers : ""));
  }
  return bar;
}

function spanBar(span, numBlocks) {
  const bar = el("div", {"class": "spanbar", "title": span.start + ":" + span.end});
  const pct = (n) => (100 * n / numBlocks) + "%";
  bar.appendChild(el("div", {"style": "width:" + pct(span.start)}));
  bar.appendChild(el("div", {"class": "on", "style": "width:" + pct(span.length)}));
  return bar;
}

function serverTable(report) {
  const table = el("table", {"class": "servers", "data-testid": "servers"});
  const head = el("tr");
  for (const [c, numeric] of COLUMNS) head.appendChild(el("th", numeric ? {"class": "num"} : {}, c));
  table.appendChild(el("thead")).appendChild(head);
  const body = table.appendChild(el("tbody"));
  const rows = [...report.server_rows].sort((a, b) => a.span.start - b.span.start || a.span.end - b.span.end);
  for (const row of rows) {
    const info = row.span.server_info;
    const tr = el("tr", {"class": "server-row", "data-peer-id": row.peer_id, "data-state": row.state});
    const pings = Object.entries(info.next_pings || {}).map(
      ([p, t]) => "..." + p.slice(-6) + " " + (t === null ? "inf" : (1000 * t).toFixed(1) + " ms")).join(", ");
    const blocks = el("td");
    blocks.appendChild(el("span", {"class": "mono"}, row.span.start + ":" + row.span.end + " "));
    blocks.appendChild(spanBar(row.span, report.num_blocks));
    const load = row.load || {};
    const relay = info.using_relay === null || info.using_relay === undefined ? "?" : (info.using_relay ? "yes" : "no");
    const details = row.peer_id + "\\nversion " + (info.version || "?") + ", dtype " + (info.torch_dtype || "?") +
      ", quant " + (info.quant_type || "?") +
      ", relay " + relay + "\\nforward rps " + num(info.forward_rps, 1) + ", network rps " + num(info.network_rps, 1) +
      "\\nadapters: " + (row.adapters.map((a) => a.short_name).join(", ") || "none");
    // a move in progress: "fetching a:b" while it serves its span and fetches the next one's weights, "moving" while
    // it reloads (serving nothing)
    const fetching = "fetching " + (load.moving_to ? load.moving_to[0] + ":" + load.moving_to[1] : "");
    const state = row.move === "fetching" ? fetching : (row.move === "reloading" ? "moving" : row.state);
    const cell = (text) => el("td", {"class": "num"}, text);
    const cells = [
      el("td", {}, info.public_name || ""),
      el("td", {"class": "mono", "title": details}, row.short_peer_id),
      blocks,
      el("td", {"class": "state-" + row.state}, state),
      cell(num(info.throughput, 1)),
      cell(load.sessions_active ?? ""),
      cell(load.busy_fraction === null || load.busy_fraction === undefined ? "" :
           Math.round(100 * load.busy_fraction) + "%"),
      cell(num(load.served_tps, 1)),
      cell(load.tokens_served ?? ""),
      cell(load.num_moves ?? ""),
      cell(num(info.inference_rps, 1)),
      cell(row.cache_tokens_left_per_block === undefined ? "" : row.cache_tokens_left_per_block),
      el("td", {"class": "mono pings", "title": pings}, pings),
    ];
    for (const c of cells) tr.appendChild(c);
    body.appendChild(tr);
  }
  return table;
}

function flowLine(report) {
  const f = report.flow || {};
  const line = el("div", {"class": "flow", "data-testid": "flow"});
  const part = (label, value) => { line.appendChild(el("span", {}, label + " ")); line.appendChild(el("b", {}, value));
                                   line.appendChild(el("span", {}, " \u00b7 ")); };
  part("flow (max-flow of this layout)", num(f.max_flow_tps, 1) + " tok/s");
  part("bound (any arrangement of these spans)", num(f.bound_tps, 1) + " tok/s");
  part("efficiency", f.efficiency === null || f.efficiency === undefined ? "?" : Math.round(100 * f.efficiency) + "%");
  part("weakest block", num(f.bottleneck_tps, 1) + " tok/s");
  part("served now", f.served_tps === null || f.served_tps === undefined ? "?" : num(f.served_tps, 1) + " tok/s");
  line.appendChild(el("span", {}, "moves " + (report.num_moves || 0) + " (in progress " +
                                  (report.moves_in_progress || 0) + ")"));
  return line;
}

function render(state) {
  const models = document.getElementById("models");
  models.replaceChildren();
  if (state.model_reports.length === 0) models.appendChild(el("p", {"class": "meta"}, "no models found yet"));
  for (const report of state.model_reports) {
    const section = el("section", {"class": "model", "data-prefix": report.dht_prefix, "data-state": report.state});
    const title = el("h2", {}, report.name + " ");
    title.appendChild(el("span", {"class": "badge " + report.state}, report.state));
    section.appendChild(title);
    section.appendChild(el("div", {"class": "meta"}, report.num_blocks + " blocks, " + report.num_servers +
      " online server(s), DHT prefix " + report.dht_prefix));
    section.appendChild(coverageBar(report));
    section.appendChild(flowLine(report));
    section.appendChild(serverTable(report));
    models.appendChild(section);
  }
  const issues = document.getElementById("issues");
  issues.replaceChildren();
  if (state.reachability_issues.length > 0) {
    issues.appendChild(el("h2", {}, "Reachability issues"));
    const list = issues.appendChild(el("ul", {"class": "meta"}));
    for (const issue of state.reachability_issues) {
      list.appendChild(el("li", {"class": "mono"}, issue.peer_id + ": " + issue.err));
    }
  }
  const updated = state.last_updated ? new Date(state.last_updated * 1000).toLocaleTimeString() : "never";
  document.getElementById("updated").textContent = updated;
  document.getElementById("period").textContent = state.update_period;
  document.getElementById("bootstrap").textContent = state.bootstrap_states.join(", ") || "none";
  document.body.dataset.lastUpdated = state.last_updated === null ? "" : String(state.last_updated);
  window.renderedState = state;  // what the page shows, for tools and tests that compare it with the API
}

async function refresh() {
  let period = 30;
  try {
    const response = await fetch("api/v1/state", {cache: "no-store"});
    const state = await response.json();
    period = state.update_period || period;
    render(state);
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = " (refresh failed: " + e + ")";
  }
  setTimeout(refresh, Math.max(1, Math.min(period, 60)) * 1000);
}
refresh();
</script>
</body>
</html>
"""
