// corolla chat page: streams /v1/chat/completions (SSE) of this gateway, stops a generation by aborting its fetch,
// and shows the servers of the route it runs through (/corolla/route/<id>). Text from the model or the servers is
// only ever set with textContent.
"use strict";

const ROUTE_POLL_MS = 400;
const page = {
  messages: [],        // the conversation sent with each request (system prompt excluded)
  controller: null,    // AbortController of the generation in flight
  routeId: null,
  routeTimer: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function setStatus(text, isError) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("error", Boolean(isError));
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return String(body.error.message);
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}

async function loadModels() {
  const select = $("model");
  const response = await fetch("v1/models", {headers: headers(false)});
  if (!response.ok) {
    setStatus("could not list models: " + await errorText(response) +
      (response.status === 401 ? " (enter the API key)" : ""), true);
    return;
  }
  const previous = select.value;
  select.replaceChildren();
  for (const model of (await response.json()).data || []) {
    const option = el("option", null, model.id);
    option.value = String(model.id);
    select.appendChild(option);
  }
  if (previous) select.value = previous;
  if (!select.value && select.options.length) select.selectedIndex = 0;
  setStatus("ready", false);
}

function addMessage(role, text) {
  const node = el("div", "message " + role);
  node.appendChild(el("span", "role", role));
  const content = node.appendChild(el("span", "content", text));
  $("messages").appendChild(node);
  node.scrollIntoView({block: "end"});
  return {node, content};
}

function numberField(id, fallback) {
  const value = Number($(id).value);
  return Number.isFinite(value) && $(id).value !== "" ? value : fallback;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...page.messages);
  return {
    model: $("model").value,
    messages,
    stream: true,
    temperature: numberField("temperature", 0.7),
    top_p: numberField("top-p", 1),
    max_tokens: Math.max(1, Math.round(numberField("max-tokens", 256))),
  };
}

// --- the route panel ---
function shortId(peerId) { return peerId.length > 12 ? "\u2026" + peerId.slice(-10) : peerId; }

function renderRoute(trace) {
  const panel = $("route");
  panel.dataset.state = trace.state;
  panel.dataset.steps = String(trace.steps);
  const changes = trace.route_changes ? ", route changed " + trace.route_changes + "x" : "";
  const cut = trace.route_truncated ? " (the first " + trace.route.length + " shown)" : "";
  $("route-summary").textContent = trace.state + ": " + trace.steps + " step(s) through " +
    trace.route.length + " server(s)" + cut + changes;
  const body = $("route-hops");
  body.replaceChildren();
  for (const hop of trace.route) {
    const row = el("tr", "hop");
    row.dataset.peerId = String(hop.peer_id);
    row.dataset.start = String(hop.start);
    row.dataset.end = String(hop.end);
    row.appendChild(el("td", "mono", hop.start + ":" + hop.end));
    row.appendChild(el("td", null, hop.public_name || "\u2014"));
    const peer = row.appendChild(el("td", "mono", shortId(String(hop.peer_id))));
    peer.title = String(hop.peer_id);
    row.appendChild(el("td", null, hop.transport || ""));
    body.appendChild(row);
  }
  window.renderedRoute = trace;  // for tools and tests that compare the page with /corolla/route
}

async function pollRoute(routeId) {
  if (!routeId) return null;
  const response = await fetch("corolla/route/" + encodeURIComponent(routeId), {headers: headers(false)});
  if (!response.ok) return null;
  const trace = await response.json();
  if (routeId === page.routeId) renderRoute(trace);
  return trace;
}

function startRoutePolling(routeId) {
  stopRoutePolling();
  page.routeId = routeId;
  const tick = async () => {
    await pollRoute(routeId).catch(() => null);
    if (page.routeId === routeId && page.controller) page.routeTimer = setTimeout(tick, ROUTE_POLL_MS);
  };
  tick();
}

function noRoute() {
  page.routeId = null;
  $("route").dataset.state = "none";
  $("route-summary").textContent = "the gateway reports no route (route tracking off: --route_log_entries 0)";
  $("route-hops").replaceChildren();
}

function stopRoutePolling() {
  if (page.routeTimer !== null) clearTimeout(page.routeTimer);
  page.routeTimer = null;
}

async function settleRoute(routeId) {
  // after the stream ends or is stopped: poll until the gateway says the generation is finished (bounded)
  for (let i = 0; i < 25 && routeId; i++) {
    const trace = await pollRoute(routeId).catch(() => null);
    if (trace && trace.state === "finished") return;
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

// --- streaming ---
function* sseData(buffer) {
  // yields each complete event's data and leaves the rest in buffer.rest (SSE: lines, events end with a blank line)
  let text = buffer.rest;
  let end;
  while ((end = text.search(/\r?\n\r?\n/)) >= 0) {
    const event = text.slice(0, end);
    text = text.slice(end).replace(/^\r?\n\r?\n/, "");
    const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
    if (data) yield data;
  }
  buffer.rest = text;
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
  document.body.dataset.state = running ? "streaming" : document.body.dataset.state;
}

async function send() {
  const prompt = $("prompt").value.trim();
  if (!prompt || page.controller) return;
  if (!$("model").value) await loadModels();
  $("prompt").value = "";
  page.messages.push({role: "user", content: prompt});
  addMessage("user", prompt);
  const reply = addMessage("assistant", "");
  reply.node.classList.add("streaming");
  const controller = new AbortController();
  page.controller = controller;
  setRunning(true);
  setStatus("generating\u2026", false);
  let text = "", outcome = "done", finishReason = null, routeId = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    routeId = response.headers.get("x-corolla-route-id");
    if (routeId) startRoutePolling(routeId);
    else if (response.ok) noRoute();
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const buffer = {rest: ""};
    let finished = false;
    while (!finished) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer.rest += decoder.decode(value, {stream: true});
      for (const data of sseData(buffer)) {
        if (data === "[DONE]") { finished = true; break; }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(String(chunk.error.message || "generation failed"));
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        if (choice.delta && typeof choice.delta.content === "string" && choice.delta.content) {
          text += choice.delta.content;
          reply.content.textContent = text;
          reply.node.scrollIntoView({block: "end"});
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
    setStatus("done" + (finishReason ? " (" + finishReason + ")" : ""), false);
  } catch (e) {
    if (e.name === "AbortError") {
      outcome = "stopped";
      setStatus("stopped", false);
      reply.node.appendChild(el("span", "note", "[stopped]"));
    } else {
      outcome = "error";
      setStatus("error: " + e.message, true);
      reply.node.appendChild(el("span", "note", "[error: " + e.message + "]"));
    }
  } finally {
    reply.node.classList.remove("streaming");
    if (text) page.messages.push({role: "assistant", content: text});
    else page.messages.pop();  // nothing came back: the prompt may be sent again
    page.controller = null;
    stopRoutePolling();
    setRunning(false);
    await settleRoute(routeId);
    document.body.dataset.state = outcome;
  }
}

function init() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (page.controller) page.controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (page.controller) page.controller.abort();
    page.messages = [];
    $("messages").replaceChildren();
  });
  $("api-key").addEventListener("change", () => loadModels().catch((e) => setStatus(String(e), true)));
  loadModels().catch((e) => setStatus("could not reach the gateway: " + e.message, true));
}

document.addEventListener("DOMContentLoaded", init);
