// qserve playground: a chat over /v1/chat/completions (streamed) and a model panel over
// /server_info. Plain JavaScript, no dependencies; the API key (with --api-key) lives in
// sessionStorage only, so it is gone when the tab closes.
"use strict";

const KEY_STORAGE = "qserve.apiKey";
const INFO_INTERVAL_MS = 1000;
const $ = (id) => document.getElementById(id);

const state = {
  model: null, // the served name, from /server_info
  history: [], // {role, content} sent with the next message
  controller: null, // the AbortController of the reply streaming now
};

class ServerError extends Error {}

// -- API key ------------------------------------------------------------------------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function requestHeaders(json) {
  const headers = {};
  if (json) headers["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = apiKey() ? message : "";
  $("forget-key").hidden = !apiKey();
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("api-key").value);
  $("api-key").value = "";
  $("key-error").textContent = "";
  refreshInfo();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  $("forget-key").hidden = true;
  refreshInfo();
}

// The server's own words for a failed request ({"error": {"message"}}), else the status.
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (err) {
    // not JSON: fall through
  }
  const status = `HTTP ${response.status} ${response.statusText}`.trim();
  return text ? `${status}: ${text.slice(0, 300)}` : status;
}

// -- model panel --------------------------------------------------------------------------

async function refreshInfo() {
  let response;
  try {
    response = await fetch("/server_info", { headers: requestHeaders(false), cache: "no-store" });
  } catch (err) {
    $("server-status").textContent = "server unreachable";
    return;
  }
  if (response.status === 401) {
    const message = await errorMessage(response);
    askForKey(message);
    $("server-status").textContent = "API key needed";
    return;
  }
  if (!response.ok) {
    $("info-error").textContent = await errorMessage(response);
    return;
  }
  $("key-form").hidden = true;
  $("forget-key").hidden = !apiKey();
  $("info-error").textContent = "";
  $("server-status").textContent = "";
  showInfo(await response.json());
}

function showInfo(info) {
  state.model = info.model;
  $("model-name").textContent = info.model;
  $("info-model").textContent = info.model;
  $("info-root").textContent = info.root;
  $("info-arch").textContent = info.architecture;
  $("info-dtype").textContent = `${info.dtype} / ${info.device}`;
  $("info-max-len").textContent = String(info.max_model_len);
  $("info-scheme").textContent = info.quantization.scheme;
  showKernelPaths(info.quantization.kernel_paths);
  showExtra(info);
  const kv = info.kv_cache;
  const usage = info.kv_cache_usage;
  $("kv-size").textContent = `${kv.num_blocks} blocks × ${kv.block_size} tokens = ` +
    `${kv.num_tokens} tokens, ${formatBytes(kv.bytes)} (${kv.dtype})`;
  $("kv-used").textContent = String(usage.used_blocks);
  $("kv-total").textContent = String(kv.num_blocks);
  $("kv-meter").value = kv.num_blocks ? usage.used_blocks / kv.num_blocks : 0;
  $("req-running").textContent = String(info.requests.running);
  $("req-waiting").textContent = String(info.requests.waiting);
}

function showKernelPaths(paths) {
  const body = $("kernel-paths").tBodies[0];
  const rows = Object.entries(paths).map(([kind, path]) => {
    const row = document.createElement("tr");
    for (const text of [kind, path]) {
      const cell = document.createElement("td");
      cell.textContent = text;
      row.appendChild(cell);
    }
    return row;
  });
  body.replaceChildren(...rows);
}

function showExtra(info) {
  const parts = [];
  const q = info.quantization;
  if (q.merged.length) parts.push("merged: " + q.merged.join(", "));
  if (q.cpu_kernels) {
    parts.push("CPU kernels: " + Object.entries(q.cpu_kernels).map((e) => e.join(" ")).join(", "));
  }
  const p = info.parallel;
  if (p.tensor_parallel_size > 1) parts.push(`tensor parallel ×${p.tensor_parallel_size}`);
  if (p.pipeline_parallel_size > 1) parts.push(`pipeline parallel ×${p.pipeline_parallel_size}`);
  $("info-extra").textContent = parts.join(" · ");
}

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

// -- chat ---------------------------------------------------------------------------------

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "message " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(body, stats);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, stats };
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    messages: messages.concat(state.history),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (state.model) body.model = state.model;
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
    const value = numberField(name);
    if (value !== null) body[name] = value;
  }
  if ($("ignore_eos").checked) body.ignore_eos = true;
  return body;
}

// Calls onChunk with each JSON chunk of an SSE stream until [DONE]; an error event throws.
async function readStream(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (!line.startsWith("data:")) continue; // comments (keep-alive pings), blank lines
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message);
      onChunk(chunk);
    }
  }
}

function onChunk(chunk, run, reply) {
  if (chunk.usage) run.usage = chunk.usage;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const text = choice.delta && choice.delta.content;
  if (text) {
    if (run.firstAt === null) run.firstAt = performance.now();
    run.text += text;
    run.chunks += 1;
    reply.body.textContent = run.text;
    reply.stats.textContent = `time to first token ${formatMs(run.firstAt - run.sentAt)} · ` +
      `${run.chunks} chunks so far`;
  }
  if (choice.finish_reason) run.finishReason = choice.finish_reason;
}

function formatMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

function replyStats(run, outcome) {
  const end = performance.now();
  const parts = [];
  if (run.firstAt !== null) parts.push(`time to first token ${formatMs(run.firstAt - run.sentAt)}`);
  const tokens = run.usage ? run.usage.completion_tokens : null;
  if (tokens !== null && run.firstAt !== null && tokens > 1 && end > run.firstAt) {
    // tokens after the first over the time after the first: the decode rate
    parts.push(`${((tokens - 1) / ((end - run.firstAt) / 1000)).toFixed(1)} tokens/s`);
  }
  if (run.usage) {
    parts.push(`${run.usage.prompt_tokens} prompt + ${run.usage.completion_tokens} completion ` +
      `= ${run.usage.total_tokens} tokens`);
  }
  if (outcome === "stopped") {
    parts.push(`stopped after ${run.chunks} chunks (${formatMs(end - run.sentAt)})`);
  } else if (run.finishReason) {
    parts.push(`finish: ${run.finishReason}`);
  }
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  addMessage("user", text);
  state.history.push({ role: "user", content: text });
  const reply = addMessage("assistant", "");
  const run = { text: "", chunks: 0, usage: null, finishReason: null, firstAt: null,
    sentAt: performance.now() };
  const controller = new AbortController();
  state.controller = controller;
  reply.box.dataset.state = "streaming";
  setBusy(true);
  try {
    await streamReply(requestBody(), controller.signal, run, reply);
    finishReply(reply, run, "done");
  } catch (err) {
    if (controller.signal.aborted) finishReply(reply, run, "stopped");
    else failReply(reply, run, err);
  } finally {
    state.controller = null;
    setBusy(false);
    refreshInfo();
  }
}

async function streamReply(body, signal, run, reply) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: requestHeaders(true),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) {
    const message = await errorMessage(response);
    if (response.status === 401) askForKey(message);
    throw new ServerError(message);
  }
  await readStream(response, (chunk) => onChunk(chunk, run, reply));
}

function finishReply(reply, run, outcome) {
  reply.box.dataset.state = outcome;
  reply.stats.textContent = replyStats(run, outcome);
  state.history.push({ role: "assistant", content: run.text });
}

function failReply(reply, run, err) {
  reply.box.dataset.state = "error";
  const message = err instanceof ServerError ? err.message : `request failed: ${err.message}`;
  reply.body.textContent = run.text ? `${run.text}\n\n${message}` : message;
  reply.stats.textContent = "error";
  if (!run.text) state.history.pop(); // the user's turn got no answer: not kept
  else state.history.push({ role: "assistant", content: run.text });
}

function stop() {
  if (state.controller) state.controller.abort(); // the server sees the disconnect and aborts
}

function clearChat() {
  stop();
  state.history = [];
  $("messages").replaceChildren();
}

function onPromptKey(event) {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
}

function start() {
  $("chat-form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", onPromptKey);
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  $("key-form").addEventListener("submit", useKey);
  $("forget-key").addEventListener("click", forgetKey);
  refreshInfo();
  setInterval(refreshInfo, INFO_INTERVAL_MS);
}

start();
