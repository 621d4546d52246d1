// The logprobs page: no dependencies, no build step, nothing fetched but this server's own API.
"use strict";

const KEY_STORE = "omlx_logprobs.api_key";
const $ = (id) => document.getElementById(id);

const state = {
  keyRequired: false,
  model: null,
  generation: null, // {request, response, endpoint} of the last run
  scoring: null,
  abort: null,
  pinned: null, // the token element whose card stays open
  image: null, // the chat message's image as a data URL, sent as an image_url part
};

// ---------- the API ----------

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.keyRequired && apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function call(path, body, signal) {
  const init = { method: body ? "POST" : "GET", headers: headers(), signal };
  if (body) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (!r.ok) {
    let message = r.status + " " + r.statusText;
    try {
      const e = (await r.json()).error;
      if (e && e.message) message = e.message + (e.param ? ` (param: ${e.param})` : "");
    } catch (_) { /* not JSON */ }
    if (r.status === 401) askKey("The server refused the key: " + message);
    throw new ApiError(r.status, message);
  }
  return r;
}

// Server-sent events: one parsed JSON object per `data:` event, until `[DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// ---------- API key ----------

function askKey(message) {
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("key-input").focus();
}

function setupKey() {
  $("key-form").addEventListener("submit", () => {
    localStorage.setItem(KEY_STORE, $("key-input").value.trim());
    loadModels();
  });
  $("key-forget").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORE);
    $("key-input").value = "";
  });
  $("key-button").addEventListener("click", () => askKey(""));
}

async function loadModels() {
  try {
    const r = await call("/v1/models");
    const models = (await r.json()).data.map((m) => m.id);
    const select = $("model");
    select.replaceChildren(...models.map((id) => new Option(id, id)));
    state.model = models[0] || null;
    document.body.dataset.ready = "true";
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) showError("gen", e);
  }
}

// ---------- tokens: text, colour, card ----------

const utf8 = new TextEncoder();
const strict = new TextDecoder("utf-8", { fatal: true });

// What a token shows: its bytes as text when they are whole UTF-8, else its token string.
function shown(entry) {
  if (entry.bytes) {
    try {
      return strict.decode(new Uint8Array(entry.bytes));
    } catch (_) { /* a piece of a character: the token string stands in */ }
  }
  return entry.token;
}

// Whitespace made visible, for the card and for tokens that are only whitespace.
function visible(text) {
  return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "→").replace(/\r/g, "␍");
}

// 0 = expected, 1 = as surprising as the scale goes; yellow through orange to red.
function heat(x) {
  x = Math.max(0, Math.min(1, x));
  if (x < 0.02) return "transparent";
  const hue = 50 - 46 * x;
  const alpha = 0.14 + 0.6 * Math.pow(x, 0.85);
  return `hsla(${hue.toFixed(1)}, 92%, 57%, ${alpha.toFixed(3)})`;
}

const fmt = (x, d = 4) => (x === null || x === undefined || Number.isNaN(x) ? "–" : x.toFixed(d));
const pct = (lp) => {
  const p = Math.exp(lp);
  if (p >= 0.9995) return "100%";
  if (p >= 0.001) return (100 * p).toFixed(p >= 0.1 ? 1 : 2) + "%";
  return p.toExponential(1);
};

// A token element. entry: {token, logprob, bytes, top: [{token, logprob, bytes, rank?}], rank?,
// k?, bytesFromText?}; x: its shade; decoder: the section's streaming UTF-8 decoder, so that a
// character split over tokens appears whole in the token that completes it (the tokens before
// it show an empty box) and the elements' text is exactly the answer's text.
function tokenElement(entry, x, decoder) {
  const el = document.createElement("span");
  el.className = "tok";
  let text;
  if (entry.bytes === null) {
    text = entry.token;
    el.classList.add("special");
  } else if (decoder && !entry.bytesFromText) {
    text = decoder.decode(new Uint8Array(entry.bytes), { stream: true });
  } else {
    text = entry.token;
  }
  el.textContent = text;
  if (text === "") el.classList.add("partial");
  else if (/^\s+$/.test(text)) el.classList.add(text.includes("\n") ? "nl" : "ws");
  if (entry.logprob !== null) {
    el.dataset.logprob = String(entry.logprob);
    el.style.backgroundColor = heat(x);
  } else {
    el.classList.add("unscored");
  }
  el.entry = entry;
  el.tabIndex = 0;
  return el;
}

// Rank from the top list when the API does not give it (chat and legacy entries): the place in
// the list, best first, when the token is among the first k; beyond them it is unknown.
function rankOf(entry) {
  if (entry.rank !== undefined) return String(entry.rank);
  if (!entry.top.length) return "–";
  const k = entry.k ?? entry.top.length;
  const i = entry.top.findIndex((t) => t.token === entry.token && t.logprob === entry.logprob);
  return i >= 0 && i < k ? String(i + 1) : "> " + k;
}

function hex(bytes) {
  return bytes.map((b) => b.toString(16).padStart(2, "0")).join(" ");
}

function card(el) {
  const e = el.entry;
  const tip = $("tip");
  tip.replaceChildren();
  const head = div("tip-head");
  const chip = span("chip" + (e.bytes === null ? " special" : ""), visible(shown(e)) || "∅");
  head.append(chip);
  if (e.section) head.append(span("section-name", e.section));
  tip.append(head);
  if (e.logprob === null) {
    tip.append(div("muted", "The first token: nothing before it to predict it from."));
  } else {
    const facts = div("facts");
    facts.append(
      fact("probability", pct(e.logprob)),
      fact("logprob", fmt(e.logprob)),
      fact("rank", rankOf(e)),
      fact("surprisal", fmt(-e.logprob / Math.LN2, 2) + " bits"),
    );
    tip.append(facts);
  }
  const bytes = e.bytes ? hex(e.bytes) : e.bytes === null ? "none (special token)" : "";
  if (bytes) {
    const b = div("bytes");
    b.append(span("label", e.bytesFromText ? "UTF-8" : "bytes"), span("mono", bytes));
    if (e.id !== undefined) b.append(span("label id", "id " + e.id));
    tip.append(b);
  }
  if (e.top.length) {
    const list = document.createElement("ol");
    list.className = "top";
    let own = false;
    const k = e.k ?? e.top.length;
    e.top.forEach((t, i) => {
      const mine = t.token === e.token && t.logprob === e.logprob;
      own = own || mine;
      const rank = t.rank !== undefined ? String(t.rank) : i < k ? String(i + 1) : "";
      list.append(topRow(t, rank, mine));
    });
    tip.append(list);
    if (!own && e.logprob !== null) {
      tip.append(div("muted note", `The chosen token is not among the top ${k}.`));
    }
  }
  tip.hidden = false;
  place(tip, el);
}

function topRow(t, rank, mine) {
  const li = document.createElement("li");
  if (mine) li.className = "mine";
  const bar = span("meter");
  const fill = span("fill");
  fill.style.width = (100 * Math.exp(t.logprob)).toFixed(2) + "%";
  bar.append(fill);
  li.append(
    span("rank", rank),
    span("chip small", visible(shown(t)) || "∅"),
    bar,
    span("p", pct(t.logprob)),
    span("lp", fmt(t.logprob, 3)),
  );
  li.title = t.bytes ? "bytes " + hex(t.bytes) : "";
  return li;
}

function place(tip, el) {
  const r = el.getBoundingClientRect();
  const w = tip.offsetWidth;
  const h = tip.offsetHeight;
  const view = document.documentElement; // the viewport less its scroll bars
  const left = Math.max(8, Math.min(view.clientWidth - w - 8, r.left));
  let top = r.bottom + 6;
  if (top + h > view.clientHeight - 8 && r.top - h - 6 > 8) top = r.top - h - 6;
  tip.style.left = left + window.scrollX + "px";
  tip.style.top = top + window.scrollY + "px";
}

function hideCard() {
  if (state.pinned) state.pinned.classList.remove("pinned");
  state.pinned = null;
  $("tip").hidden = true;
}

function setupCards() {
  for (const out of [$("gen-output"), $("score-output")]) {
    out.addEventListener("mouseover", (ev) => {
      const el = ev.target.closest(".tok");
      if (el && !state.pinned) card(el);
    });
    out.addEventListener("mouseleave", () => {
      if (!state.pinned) $("tip").hidden = true;
    });
    out.addEventListener("click", (ev) => {
      const el = ev.target.closest(".tok");
      if (!el) return;
      const same = state.pinned === el;
      hideCard();
      if (same) return;
      state.pinned = el;
      el.classList.add("pinned");
      card(el);
      ev.stopPropagation();
    });
    out.addEventListener("focusin", (ev) => {
      const el = ev.target.closest(".tok");
      if (el && !state.pinned) card(el);
    });
  }
  document.addEventListener("click", (ev) => {
    if (state.pinned && !$("tip").contains(ev.target)) hideCard();
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") hideCard();
  });
}

// ---------- small DOM helpers ----------

function div(cls, text) {
  const d = document.createElement("div");
  d.className = cls;
  if (text !== undefined) d.textContent = text;
  return d;
}

function span(cls, text) {
  const s = document.createElement("span");
  s.className = cls;
  if (text !== undefined) s.textContent = text;
  return s;
}

function fact(label, value) {
  const d = div("fact");
  d.append(span("label", label), span("value", value));
  return d;
}

function showError(view, e) {
  const box = $(view + "-error");
  box.hidden = false;
  box.textContent = e instanceof ApiError ? e.message : "Error: " + (e.message || e);
}

// ---------- an image with the chat message ----------

function setImage(url) {
  state.image = url;
  $("image-thumb").src = url || "";
  $("image-preview").hidden = !url;
  if (!url) $("image").value = "";
}

function readImage(file) {
  if (!file || !file.type.startsWith("image/")) return;
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result);
  reader.readAsDataURL(file);
}

function wireImage() {
  $("image").addEventListener("change", () => readImage($("image").files[0]));
  $("image-clear").addEventListener("click", () => setImage(null));
  $("user").addEventListener("paste", (ev) => {
    const item = [...(ev.clipboardData?.items || [])].find((i) => i.type.startsWith("image/"));
    if (item) {
      ev.preventDefault();
      readImage(item.getAsFile());
    }
  });
  const drop = $("chat-fields");
  drop.addEventListener("dragover", (ev) => ev.preventDefault());
  drop.addEventListener("drop", (ev) => {
    const file = [...(ev.dataTransfer?.files || [])].find((f) => f.type.startsWith("image/"));
    if (file) {
      ev.preventDefault();
      readImage(file);
    }
  });
}

// ---------- generation ----------

function mode() {
  return document.querySelector('input[name="mode"]:checked').value;
}

function num(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function generationRequest() {
  const chat = mode() === "chat";
  const body = { model: state.model || $("model").value };
  if (chat) {
    const messages = [];
    if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value });
    const text = $("user").value;
    const content = state.image
      ? [{ type: "image_url", image_url: { url: state.image } }, { type: "text", text }]
      : text;
    messages.push({ role: "user", content });
    body.messages = messages;
  } else {
    body.prompt = $("prompt").value;
  }
  body.max_tokens = num("max_tokens") ?? 128;
  body.temperature = num("temperature") ?? 1;
  if ((num("top_p") ?? 1) < 1) body.top_p = num("top_p");
  if ((num("top_k") ?? 0) > 0) body.top_k = num("top_k");
  if ((num("min_p") ?? 0) > 0) body.min_p = num("min_p");
  if (num("seed") !== null) body.seed = num("seed");
  if ($("stop").value) body.stop = [$("stop").value];
  const k = num("top_logprobs") ?? 0;
  if (chat) {
    body.logprobs = true;
    body.top_logprobs = k;
    const tools = $("tools").value.trim();
    if (tools) body.tools = JSON.parse(tools);
  } else {
    body.logprobs = k;
  }
  body.stream = $("stream").checked;
  if (body.stream) body.stream_options = { include_usage: true };
  return { endpoint: chat ? "/v1/chat/completions" : "/v1/completions", body };
}

// The output area: sections (reasoning, answer, tool calls), each made on its first token.
const SECTIONS = {
  reasoning_content: "Reasoning",
  content: "Answer",
  tool_calls: "Tool calls",
  text: "Completion",
};

class Output {
  constructor(root) {
    this.root = root;
    this.sections = {};
    this.calls = []; // tool calls as they stream: {id, name, arguments}
    this.logprobs = [];
    root.replaceChildren();
  }

  section(name) {
    if (!this.sections[name]) {
      const box = div("section " + name.replace("_", "-"));
      box.dataset.section = name;
      box.append(div("section-title", SECTIONS[name]));
      if (name === "tool_calls") box.append(div("calls"));
      box.append(div("tokens"));
      box.decoder = new TextDecoder("utf-8");
      // reasoning first, then the answer, then tool calls, whatever order they come in
      const order = Object.keys(SECTIONS);
      const after = [...this.root.children].find(
        (c) => order.indexOf(c.dataset.section) > order.indexOf(name));
      this.root.insertBefore(box, after || null);
      this.sections[name] = box;
    }
    return this.sections[name];
  }

  add(name, entries) {
    const box = this.section(name);
    const tokens = box.querySelector(".tokens");
    const frag = document.createDocumentFragment();
    for (const e of entries) {
      e.section = SECTIONS[name];
      frag.append(tokenElement(e, 1 - Math.exp(e.logprob), box.decoder));
      this.logprobs.push(e.logprob);
    }
    tokens.append(frag);
  }

  toolCalls(deltas) {
    for (const d of deltas) {
      const i = d.index ?? this.calls.length;
      const c = (this.calls[i] = this.calls[i] || { id: "", name: "", arguments: "" });
      if (d.id) c.id = d.id;
      if (d.function && d.function.name) c.name += d.function.name;
      if (d.function && d.function.arguments) c.arguments += d.function.arguments;
    }
    const list = this.section("tool_calls").querySelector(".calls");
    list.replaceChildren(...this.calls.filter(Boolean).map((c) => {
      const row = div("call");
      row.append(span("fn", c.name || "?"), span("args mono", c.arguments));
      return row;
    }));
  }
}

function chatEntries(list, k) {
  return (list || []).map((e) => ({
    k,
    token: e.token,
    logprob: e.logprob,
    bytes: e.bytes,
    top: (e.top_logprobs || []).map((t) => ({ token: t.token, logprob: t.logprob, bytes: t.bytes })),
  }));
}

function legacyEntries(lp, k) {
  if (!lp) return [];
  return lp.tokens.map((token, i) => ({
    k,
    token,
    logprob: lp.token_logprobs[i],
    bytes: [...utf8.encode(token)],
    bytesFromText: true,
    top: Object.entries(lp.top_logprobs[i] || {})
      .map(([t, v]) => ({ token: t, logprob: v, bytes: [...utf8.encode(t)] }))
      .sort((a, b) => b.logprob - a.logprob),
  }));
}

// One chunk (streamed) or one response (not): the first choice's tokens into their sections.
function render(out, choice, chat, k) {
  if (!choice) return;
  if (!chat) {
    out.add("text", legacyEntries(choice.logprobs, k));
    return;
  }
  const lp = choice.logprobs || {};
  for (const name of ["reasoning_content", "content", "tool_calls"]) {
    if (Array.isArray(lp[name]) && lp[name].length) out.add(name, chatEntries(lp[name], k));
  }
  const calls = (choice.delta || choice.message || {}).tool_calls;
  if (calls && calls.length) out.toolCalls(calls);
}

// A streamed run as one response object, as if it had not been streamed (for the export).
class Assembler {
  constructor(chat) {
    this.chat = chat;
    this.response = null;
  }

  add(chunk) {
    if (!this.response) {
      this.response = { id: chunk.id, object: this.chat ? "chat.completion" : "text_completion",
        created: chunk.created, model: chunk.model, choices: [], usage: null };
    }
    if (chunk.usage) this.response.usage = chunk.usage;
    for (const c of chunk.choices || []) {
      const r = (this.response.choices[c.index] = this.response.choices[c.index] || this.empty(c.index));
      if (c.finish_reason) r.finish_reason = c.finish_reason;
      if (this.chat) this.addChat(r, c);
      else this.addText(r, c);
    }
  }

  empty(index) {
    if (!this.chat) {
      return { index, text: "", finish_reason: null,
        logprobs: { tokens: [], token_logprobs: [], top_logprobs: [], text_offset: [] } };
    }
    return { index, message: { role: "assistant", content: "" }, finish_reason: null,
      logprobs: { content: [] } };
  }

  addChat(r, c) {
    const d = c.delta || {};
    for (const key of ["content", "reasoning_content"]) {
      if (typeof d[key] === "string") r.message[key] = (r.message[key] || "") + d[key];
    }
    if (d.tool_calls) {
      const calls = (r.message.tool_calls = r.message.tool_calls || []);
      for (const t of d.tool_calls) {
        const i = t.index ?? calls.length;
        const call = (calls[i] = calls[i] || { id: t.id, type: "function",
          function: { name: "", arguments: "" } });
        if (t.function && t.function.name) call.function.name += t.function.name;
        if (t.function && t.function.arguments) call.function.arguments += t.function.arguments;
      }
    }
    const lp = c.logprobs;
    if (!lp) return;
    for (const [key, list] of Object.entries(lp)) {
      if (Array.isArray(list)) r.logprobs[key] = (r.logprobs[key] || []).concat(list);
    }
  }

  addText(r, c) {
    r.text += c.text || "";
    const lp = c.logprobs;
    if (!lp) return;
    for (const key of ["tokens", "token_logprobs", "top_logprobs", "text_offset"]) {
      r.logprobs[key] = r.logprobs[key].concat(lp[key] || []);
    }
  }
}

function stats(out, started, usage) {
  const lps = out.logprobs.filter((x) => x !== null);
  const box = $("gen-stats");
  box.replaceChildren();
  if (!lps.length) return;
  const sum = lps.reduce((a, b) => a + b, 0);
  const seconds = (performance.now() - started) / 1000;
  box.append(
    fact("tokens", String(lps.length)),
    fact("sum logprob", fmt(sum, 3)),
    fact("mean p", pct(Math.log(lps.reduce((a, b) => a + Math.exp(b), 0) / lps.length))),
    fact("perplexity", fmt(Math.exp(-sum / lps.length), 3)),
    fact("time", seconds.toFixed(2) + " s"),
  );
  if (usage) box.append(fact("prompt tokens", String(usage.prompt_tokens)));
}

async function generate() {
  if (state.abort) return;
  let req;
  try {
    req = generationRequest();
  } catch (e) {
    showError("gen", new Error("tools: " + e.message));
    return;
  }
  const chat = req.endpoint === "/v1/chat/completions";
  const k = chat ? req.body.top_logprobs : req.body.logprobs;
  hideCard();
  $("gen-error").hidden = true;
  $("gen-stats").replaceChildren();
  const out = new Output($("gen-output"));
  const output = $("gen-output");
  output.dataset.state = "running";
  state.abort = new AbortController();
  $("run").disabled = true;
  $("stop-run").hidden = false;
  const started = performance.now();
  const assembler = new Assembler(chat);
  state.generation = { request: req, response: null };
  try {
    const r = await call(req.endpoint, req.body, state.abort.signal);
    if (req.body.stream) {
      for await (const chunk of events(r)) {
        if (chunk.error) throw new Error(chunk.error.message || "stream error");
        assembler.add(chunk);
        render(out, (chunk.choices || [])[0], chat, k);
        stats(out, started, chunk.usage);
      }
      state.generation.response = assembler.response;
    } else {
      const body = await r.json();
      state.generation.response = body;
      render(out, body.choices[0], chat, k);
      stats(out, started, body.usage);
    }
    if (!out.logprobs.length) output.append(div("empty", "The model returned no tokens."));
  } catch (e) {
    if (e.name !== "AbortError") showError("gen", e);
    state.generation.response = state.generation.response || assembler.response;
  } finally {
    output.dataset.state = "done";
    state.abort = null;
    $("run").disabled = false;
    $("stop-run").hidden = true;
    $("gen-export").disabled = !state.generation.response;
  }
}

// ---------- prompt scoring ----------

function scoringRequest() {
  const k = num("score-k") ?? 5;
  return {
    endpoint: "/v1/completions",
    body: {
      model: state.model || $("model").value,
      prompt: $("score-text").value,
      max_tokens: 0,
      echo: true,
      logprobs: k,
      prompt_logprobs: k,
      return_token_ids: true,
    },
  };
}

// One entry a prompt position: the echoed token and logprob, the top list (with ranks and
// ids) from prompt_logprobs.
function scoredEntries(choice) {
  const lp = choice.logprobs;
  const ids = choice.prompt_token_ids || [];
  const plp = choice.prompt_logprobs || [];
  return lp.tokens.map((token, i) => {
    const e = { token, logprob: lp.token_logprobs[i], bytes: [...utf8.encode(token)],
      bytesFromText: true, top: [], id: ids[i] };
    const pos = plp[i];
    if (pos) {
      const own = pos[String(ids[i])];
      if (own) e.rank = own.rank;
      e.top = Object.entries(pos)
        .map(([id, v]) => ({ token: v.decoded_token, logprob: v.logprob, rank: v.rank,
          bytes: [...utf8.encode(v.decoded_token)], id: Number(id) }))
        .sort((a, b) => b.logprob - a.logprob);
    }
    return e;
  });
}

function totals(entries) {
  const scored = entries.map((e) => e.logprob).filter((x) => x !== null);
  const sum = scored.reduce((a, b) => a + b, 0);
  const n = scored.length;
  return { tokens: entries.length, scored: n, sum, mean: n ? sum / n : NaN,
    perplexity: n ? Math.exp(-sum / n) : NaN, bits: -sum / Math.LN2 };
}

function showTotals(t) {
  const box = $("score-totals");
  const item = (key, label, value, exact) => {
    const d = fact(label, value);
    d.dataset.key = key;
    if (exact !== undefined) d.dataset.value = String(exact);
    return d;
  };
  box.replaceChildren(
    item("tokens", "tokens", `${t.tokens} (${t.scored} scored)`, t.scored),
    item("sum", "log-likelihood", fmt(t.sum, 4) + " nats", t.sum),
    item("bits", "total surprisal", fmt(t.bits, 2) + " bits", t.bits),
    item("mean", "mean logprob", fmt(t.mean, 4), t.mean),
    item("perplexity", "perplexity", fmt(t.perplexity, 3), t.perplexity),
  );
}

async function score() {
  const req = scoringRequest();
  hideCard();
  $("score-error").hidden = true;
  $("score-totals").replaceChildren();
  const output = $("score-output");
  output.dataset.state = "running";
  state.scoring = { request: req, response: null };
  $("score-run").disabled = true;
  try {
    const body = await (await call(req.endpoint, req.body)).json();
    state.scoring.response = body;
    const entries = scoredEntries(body.choices[0]);
    const tokens = div("tokens");
    for (const e of entries) {
      e.section = "prompt";
      const bits = e.logprob === null ? 0 : -e.logprob / Math.LN2;
      tokens.append(tokenElement(e, bits / 10));
    }
    const section = div("section prompt");
    section.append(tokens);
    output.replaceChildren(section);
    showTotals(totals(entries));
  } catch (e) {
    showError("score", e);
  } finally {
    output.dataset.state = "done";
    $("score-run").disabled = false;
    $("score-export").disabled = !state.scoring.response;
  }
}

// ---------- the request as code, the response as a file ----------

function curl(req) {
  const q = (s) => "'" + s.replace(/'/g, "'\\''") + "'";
  const lines = [`curl ${location.origin}${req.endpoint}`, "  -H 'Content-Type: application/json'"];
  if (state.keyRequired) lines.push('  -H "Authorization: Bearer $OMLX_LOGPROBS_API_KEY"');
  if (req.body.stream) lines.push("  -N");
  lines.push("  -d " + q(JSON.stringify(req.body, null, 2)));
  return lines.join(" \\\n");
}

// Fields the openai client takes as keyword arguments; the rest go in extra_body.
const OPENAI_ARGS = new Set(["model", "messages", "prompt", "max_tokens", "temperature", "top_p",
  "seed", "stop", "logprobs", "top_logprobs", "echo", "tools", "stream", "stream_options", "n"]);

function py(v, indent) {
  const pad = "    ".repeat(indent + 1);
  const end = "    ".repeat(indent);
  if (v === null) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "string" || typeof v === "number") return JSON.stringify(v);
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + py(x, indent + 1) + ",\n").join("") + end + "]";
  }
  const keys = Object.keys(v);
  if (!keys.length) return "{}";
  return "{\n" + keys.map((k) => pad + JSON.stringify(k) + ": " + py(v[k], indent + 1) + ",\n")
    .join("") + end + "}";
}

function python(req) {
  const chat = req.endpoint === "/v1/chat/completions";
  const extra = {};
  const args = [];
  for (const [k, v] of Object.entries(req.body)) {
    if (OPENAI_ARGS.has(k)) args.push(`    ${k}=${py(v, 1)},`);
    else extra[k] = v;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, 1)},`);
  const key = state.keyRequired ? 'os.environ["OMLX_LOGPROBS_API_KEY"]' : '"unused"';
  const lines = [
    ...(state.keyRequired ? ["import os", ""] : []),
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url="${location.origin}/v1", api_key=${key})`,
    `r = client.${chat ? "chat.completions" : "completions"}.create(`,
    ...args,
    ")",
  ];
  if (req.body.stream) {
    lines.push("for chunk in r:", "    print(chunk.model_dump_json())");
  } else {
    lines.push("print(r.model_dump_json(indent=2))");
  }
  return lines.join("\n");
}

function showCode(view, kind) {
  let req;
  try {
    req = view === "score" ? scoringRequest() : generationRequest();
  } catch (e) {
    showError(view === "score" ? "score" : "gen", new Error("tools: " + e.message));
    return;
  }
  $("code-title").textContent = kind === "curl" ? "Request as curl" : "Request as Python (openai)";
  $("code-text").textContent = kind === "curl" ? curl(req) : python(req);
  $("code-dialog").dataset.kind = kind;
  $("code-dialog").showModal();
}

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch (_) {
    // not a secure context (a LAN address over http): select the text for Ctrl+C
    const range = document.createRange();
    range.selectNodeContents($("code-text"));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    return false;
  }
}

function exportJson(result, name) {
  if (!result || !result.response) return;
  const text = JSON.stringify({ request: { endpoint: result.request.endpoint,
    body: result.request.body }, response: result.response }, null, 2);
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  a.download = `${name}-${result.response.id || "response"}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ---------- wiring ----------

function setView(name) {
  for (const t of document.querySelectorAll(".tab")) {
    const on = t.dataset.view === name;
    t.classList.toggle("active", on);
    t.setAttribute("aria-selected", String(on));
  }
  $("view-generate").hidden = name !== "generate";
  $("view-score").hidden = name !== "score";
  hideCard();
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
}

function setMode() {
  const chat = mode() === "chat";
  $("chat-fields").hidden = !chat;
  $("completion-fields").hidden = chat;
}

async function init() {
  for (const t of document.querySelectorAll(".tab")) {
    t.addEventListener("click", () => setView(t.dataset.view));
  }
  const fromHash = () => setView(location.hash === "#score" ? "score" : "generate");
  window.addEventListener("hashchange", fromHash);
  fromHash();
  for (const r of document.querySelectorAll('input[name="mode"]')) {
    r.addEventListener("change", setMode);
  }
  setMode();
  $("model").addEventListener("change", () => (state.model = $("model").value));
  wireImage();
  $("gen-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    generate();
  });
  $("score-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    score();
  });
  for (const form of [$("gen-form"), $("score-form")]) {
    form.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) {
        ev.preventDefault();
        form.requestSubmit();
      }
    });
  }
  $("stop-run").addEventListener("click", () => state.abort && state.abort.abort());
  for (const b of document.querySelectorAll("[data-code]")) {
    const view = b.closest("#view-score") ? "score" : "generate";
    b.addEventListener("click", () => showCode(view, b.dataset.code));
  }
  $("code-close").addEventListener("click", () => $("code-dialog").close());
  $("code-copy").addEventListener("click", async () => {
    const done = await copy($("code-text").textContent);
    $("code-copy").textContent = done ? "Copied" : "Press Ctrl+C";
    setTimeout(() => ($("code-copy").textContent = "Copy"), 1500);
  });
  $("gen-export").addEventListener("click", () => exportJson(state.generation, "completion"));
  $("score-export").addEventListener("click", () => exportJson(state.scoring, "scores"));
  setupCards();
  setupKey();

  const config = await (await fetch("/page/config")).json();
  state.keyRequired = config.api_key_required;
  $("key-button").hidden = !state.keyRequired;
  $("spec-link").hidden = state.keyRequired; // the document needs the key: /docs sends it
  if (state.keyRequired && !apiKey()) {
    askKey("");
    return;
  }
  await loadModels();
}

init();
