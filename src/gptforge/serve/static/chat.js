// The chat page's behaviour (index.html lists the element ids).
//
// Chat: the conversation is kept in `messages` and sent whole to POST v1/chat/completions with
// stream: true; the answer arrives as server-sent events (`data: {chunk}` lines, then
// `data: [DONE]`), read with fetch + ReadableStream, and the text so far is rendered as Markdown
// as it grows (renderMarkdown). The last chunk (stream_options.include_usage) carries the token
// counts. With `gptforge serve --rag`, the first chunk carries `sources`, the chunks retrieved
// for the question: they are listed under the answer as citations (showSources), as text.
// Tokens/s = (completion tokens - 1) / (time of the last delta - time of the first): the decode
// rate after the first token, whose wait is shown apart as the time to first token. When every
// delta came at once (no measurable interval) it is completion tokens / time from send to the
// last delta. #stats keeps the times these come from as data-sent, data-first and data-last.
// Classifier: POST v1/classify, the label and each class's probability.
// What the server sends is shown with textContent, except answers: Markdown, rendered with the
// vendored marked and sanitized by the vendored DOMPurify (static/vendor/, loaded before this).
"use strict";

const KEY_STORE = "gptforge-api-key";
const RENDER_MS = 50; // the least time between two renders of a streaming answer
const $ = (id) => document.getElementById(id);

const chat = { messages: [], controller: null };

// ---------------------------------------------------------------------------------------------
// Markdown

// DOMPurify's defaults remove what could run (<script>, on* attributes, javascript: URLs, ...);
// styles go too (the CSP would refuse them). Its result is a DOM fragment: no HTML string of an
// answer is ever given to innerHTML.
const SANITIZE = { RETURN_DOM_FRAGMENT: true, FORBID_TAGS: ["style"], FORBID_ATTR: ["style"] };

if (window.DOMPurify) {
  // Links open in a new tab that gets no handle on this one and no referrer.
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

// Show `text` in `element` as GitHub-flavoured Markdown (code blocks, lists, tables): marked
// turns it into HTML, DOMPurify sanitizes it. Without the libraries it is shown as plain text.
function renderMarkdown(element, text) {
  if (!window.marked || !window.DOMPurify) {
    element.textContent = text;
    return;
  }
  const html = marked.parse(text, { gfm: true, async: false }).trim();
  element.replaceChildren(DOMPurify.sanitize(html, SANITIZE));
}

// A streaming answer is rendered whole each time (Markdown is not rendered piece by piece), so
// not at every delta: `schedule` renders `text()` at most once every RENDER_MS (less often when a
// render takes over a tenth of that), `flush` renders now.
function answerView(element, text) {
  let timer = null;
  let last = -Infinity;
  let gap = RENDER_MS;
  const flush = () => {
    clearTimeout(timer);
    timer = null;
    const start = performance.now();
    renderMarkdown(element, text());
    last = performance.now();
    gap = Math.max(RENDER_MS, 10 * (last - start));
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  const schedule = () => {
    if (timer === null) timer = setTimeout(flush, Math.max(0, last + gap - performance.now()));
  };
  return { schedule, flush };
}

// ---------------------------------------------------------------------------------------------
// Requests

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The message of an error answer: OpenAI's {"error": {"message": ...}} when the body is one,
// else the status line.
async function errorMessage(response) {
  let text = "";
  try { text = await response.text(); } catch (e) { /* body unreadable: the status says enough */ }
  try {
    const body = JSON.parse(text);
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}` + (text ? `: ${text.slice(0, 300)}` : "");
}

// Show the API-key box after a 401, so the user can give the key and try again.
function needKey() {
  $("auth").hidden = false;
  $("api-key").focus();
}

async function api(path, body) {
  const init = body === undefined ? { headers: headers() }
    : { method: "POST", headers: headers(), body: JSON.stringify(body) };
  const response = await fetch(path, init);
  if (response.status === 401) needKey();
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

// ---------------------------------------------------------------------------------------------
// Models

function fillSelect(select, models) {
  const previous = select.value;
  select.replaceChildren();
  for (const m of models) {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.context_length ? `${m.id} (context ${m.context_length})` : m.id;
    select.appendChild(option);
  }
  if (models.some((m) => m.id === previous)) select.value = previous;
}

async function loadModels() {
  try {
    const list = await api("v1/models");
    const models = Array.isArray(list.data) ? list.data : [];
    fillSelect($("chat-model"), models.filter((m) => m.kind !== "classify"));
    fillSelect($("classify-model"), models.filter((m) => m.kind === "classify"));
    $("chat-error").textContent = "";
    $("classify-error").textContent = "";
    document.body.dataset.modelsLoaded = "1";
  } catch (e) {
    $("chat-error").textContent = "Could not list the models: " + e.message;
    $("classify-error").textContent = "Could not list the models: " + e.message;
  }
}

// ---------------------------------------------------------------------------------------------
// Chat

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  box.append(label, content);
  $("messages").appendChild(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return content;
}

// A note after the answer's text ("[stopped]"), before its citations if it has them.
function addNote(answer, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = text;
  answer.parentNode.insertBefore(note, answer.parentNode.querySelector(".sources"));
}

// The chunks retrieved for an answer (`sources` of serve --rag, best first) as citations at
// the end of its message: "[rank] file > heading > heading", and what the context held of it.
function showSources(answer, sources) {
  const list = document.createElement("ol");
  list.className = "sources";
  list.setAttribute("aria-label", "Sources");
  for (const s of sources) {
    if (!s || typeof s !== "object") continue;
    const where = [s.file, ...(Array.isArray(s.headings) ? s.headings : [])].join(" > ");
    let state = "";
    if (s.included === "cut") {
      const whole = Array.isArray(s.span) ? ` of ${s.span[1] - s.span[0]}` : "";
      state = ` (cut to ${s.chars_included}${whole} characters)`;
    } else if (s.included === "dropped") {
      state = " (left out: no room in the context)";
    }
    const item = document.createElement("li");
    item.textContent = `[${s.rank}] ${where}${state}`;
    if (Array.isArray(s.span)) item.title = `characters ${s.span[0]}-${s.span[1]}, score ${s.score}`;
    list.appendChild(item);
  }
  answer.parentNode.appendChild(list);
}

function setStreaming(on) {
  document.body.dataset.state = on ? "streaming" : ($("chat-error").textContent ? "error" : "idle");
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function formatSeconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function showStats(t) {
  Object.assign($("stats").dataset, { sent: t.sent, first: t.first ?? "", last: t.last ?? "" });
  if (t.first === null) {
    for (const id of ["tps", "ttft", "ntokens"]) $(id).textContent = "–";
    return;
  }
  const n = t.usage ? t.usage.completion_tokens : t.deltas;
  const interval = (t.last - t.first) / 1000;
  const rate = n > 1 && interval > 0 ? (n - 1) / interval : n / ((t.last - t.sent) / 1000);
  $("tps").textContent = rate.toFixed(1);
  $("ttft").textContent = formatSeconds(t.first - t.sent);
  $("ntokens").textContent = String(n);
}

// A promise settled in a task of its own, after the events already queued (a MessageChannel
// message: unlike setTimeout, not slowed down in a background tab).
function nextTask() {
  return new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = resolve;
    channel.port2.postMessage(null);
  });
}

// Feed decoded text to the server-sent events parser: complete lines are handled, the rest
// waits in `state.buffer` for the next read. Returns true once `data: [DONE]` arrived.
function feed(state, text, onEvent) {
  state.buffer += text;
  const lines = state.buffer.split(/\r\n|\r|\n/);
  state.buffer = lines.pop();
  for (const line of lines) {
    if (!line.startsWith("data:")) continue; // blank separators, comments (": ping"), other fields
    const data = line.slice(5).trim();
    if (data === "[DONE]") return true;
    onEvent(JSON.parse(data));
  }
  return false;
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || chat.controller) return;
  $("chat-error").textContent = "";
  const model = $("chat-model").value;
  if (!model) {
    $("chat-error").textContent = "No chat model: the server lists none (see GET /v1/models).";
    return;
  }
  const messages = chat.messages; // "New chat" while this streams starts another array
  messages.push({ role: "user", content: prompt });
  const asked = addMessage("user", prompt);
  $("prompt").value = "";
  const previous = $("answer");
  if (previous) previous.removeAttribute("id");
  const answer = addMessage("assistant", "");
  answer.id = "answer";

  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;

  for (const id of ["tps", "ttft", "ntokens"]) $(id).textContent = "…";
  const t = { sent: performance.now(), first: null, last: null, deltas: 0, usage: null, cut: false };
  let text = "";
  let done = false;
  const view = answerView(answer, () => text);
  chat.controller = new AbortController();
  setStreaming(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: chat.controller.signal });
    if (response.status === 401) needKey();
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const state = { buffer: "" };
    const onEvent = (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.usage) t.usage = chunk.usage;
      if (Array.isArray(chunk.sources) && chunk.sources.length) showSources(answer, chunk.sources);
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.finish_reason === "length") t.cut = true;
      const delta = choice && choice.delta;
      if (delta && typeof delta.content === "string" && delta.content) {
        const now = performance.now();
        if (t.first === null) t.first = now;
        t.last = now;
        t.deltas += 1;
        text += delta.content;
        view.schedule();
      }
    };
    let lastYield = performance.now();
    while (!done) {
      const { value, done: ended } = await reader.read();
      if (ended) break;
      done = feed(state, decoder.decode(value, { stream: true }), onEvent);
      // Reads of data already received resolve at once, one after the other: when the
      // server is ahead of the page, let clicks (Stop) and painting in now and then.
      if (performance.now() - lastYield > 50) {
        await nextTask();
        lastYield = performance.now();
      }
    }
    if (!done) throw new Error("the stream ended before data: [DONE]");
    if (t.cut) addNote(answer, " [cut: max tokens or the model's context reached]");
  } catch (e) {
    if (e.name === "AbortError") {
      addNote(answer, " [stopped]");
    } else {
      $("chat-error").textContent = e.message;
      chat.controller.abort(); // close a stream that broke off in the middle
    }
  } finally {
    view.flush();
    // A partial answer stays in the conversation; a request that gave nothing is taken back
    // and its prompt put back in the box, to send again.
    if (text) {
      messages.push({ role: "assistant", content: text });
    } else {
      messages.pop();
      asked.parentNode.remove();
      answer.parentNode.remove();
      if (previous) previous.id = "answer";
      if (!$("prompt").value) $("prompt").value = prompt;
    }
    showStats(t);
    chat.controller = null;
    setStreaming(false);
  }
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function clearChat() {
  stop();
  chat.messages = [];
  $("messages").replaceChildren();
  $("chat-error").textContent = "";
}

// ---------------------------------------------------------------------------------------------
// Classifier

async function classify() {
  const input = $("classify-input").value;
  $("classify-error").textContent = "";
  $("classify-label").textContent = "…";
  $("classify-probs").replaceChildren();
  const body = { input };
  if ($("classify-model").value) body.model = $("classify-model").value;
  try {
    const result = await api("v1/classify", body);
    const row = result.data[0];
    $("classify-label").textContent = row.label;
    const probs = Object.entries(row.probabilities || {}).sort((a, b) => b[1] - a[1]);
    for (const [label, p] of probs) {
      const tr = document.createElement("tr");
      const name = document.createElement("td");
      name.textContent = label;
      const value = document.createElement("td");
      value.className = "probability";
      value.textContent = p.toFixed(4);
      const barCell = document.createElement("td");
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.round(p * 200)}px`;
      barCell.appendChild(bar);
      tr.append(name, value, barCell);
      $("classify-probs").appendChild(tr);
    }
  } catch (e) {
    $("classify-label").textContent = "–";
    $("classify-error").textContent = e.message;
  }
}

// ---------------------------------------------------------------------------------------------
// Wiring

function showTab(name) {
  for (const tab of ["chat", "classify"]) {
    $("tab-" + tab).setAttribute("aria-selected", String(tab === name));
    $("panel-" + tab).hidden = tab !== name;
  }
}

function saveKey() {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
  $("auth").hidden = true;
  loadModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("tab-chat").addEventListener("click", () => showTab("chat"));
  $("tab-classify").addEventListener("click", () => showTab("classify"));
  $("chat-form").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", clearChat);
  $("classify-send").addEventListener("click", classify);
  $("api-key-save").addEventListener("click", saveKey);
  $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") saveKey(); });
  if (sessionStorage.getItem(KEY_STORE)) $("api-key").value = sessionStorage.getItem(KEY_STORE);
  loadModels();
});
