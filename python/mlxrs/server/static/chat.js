// The mlxrs chat page: plain DOM, no dependencies, no CDN. Model output is only ever put into the
// page as text (textContent / text nodes): the markdown renderer below builds elements itself and
// never parses model text as HTML.
"use strict";
(function () {
  const KEY = "mlxrs.chat.apiKey", CONV = "mlxrs.chat.conversation", SETTINGS = "mlxrs.chat.settings";
  const $ = (id) => document.getElementById(id);

  // -- markdown → DOM (a safe subset: fenced code, headings, lists, paragraphs, `code`, **bold**, *italic*)
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function inline(parent, text) {
    const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
    let last = 0, m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      const t = m[0];
      if (t.startsWith("`")) parent.appendChild(el("code", null, t.slice(1, -1)));
      else if (t.startsWith("**")) parent.appendChild(el("strong", null, t.slice(2, -2)));
      else parent.appendChild(el("em", null, t.slice(1, -1)));
      last = m.index + t.length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
    return parent;
  }
  function renderMarkdown(text) {
    const frag = document.createDocumentFragment();
    const lines = String(text).split("\n");
    let para = [], list = null;
    const flush = () => {
      if (para.length) frag.appendChild(inline(el("p"), para.join("\n")));
      para = [];
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = /^\s*```(.*)$/.exec(line);
      if (fence) {
        flush();
        const body = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) body.push(lines[i]);
        const pre = el("pre"), code = el("code", null, body.join("\n"));
        if (fence[1].trim()) code.dataset.lang = fence[1].trim();
        pre.appendChild(code);
        frag.appendChild(pre);
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      const li = /^\s*(?:[-*]|\d+\.)\s+(.*)$/.exec(line);
      if (h) { flush(); frag.appendChild(inline(el("h" + Math.min(6, h[1].length + 2)), h[2])); }
      else if (li) {
        if (para.length) { frag.appendChild(inline(el("p"), para.join("\n"))); para = []; }
        if (!list) { list = el("ul"); frag.appendChild(list); }
        list.appendChild(inline(el("li"), li[1]));
      } else if (!line.trim()) flush();
      else { list = null; para.push(line); }
    }
    flush();
    return frag;
  }

  // -- state
  let conv = load(CONV, []);
  let settings = load(SETTINGS, { system: "", temperature: "", maxTokens: "" });
  let controller = null, modelId = null, vision = false;
  let attached = [];  // images picked for the next message: { name, url } (url: a data: URL)
  function load(k, dflt) { try { return JSON.parse(localStorage.getItem(k)) ?? dflt; } catch (e) { return dflt; } }
  // The conversation is kept with its images (data: URLs) while it fits the browser's storage
  // (~5 MB an origin); when it does not, it is kept without the image bytes (each image replaced by
  // { name, dropped: true }, shown as a note; not resent after a reload) and a notice says so.
  function save() {
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
    let dropped = false;
    try { localStorage.setItem(CONV, JSON.stringify(conv)); }
    catch (e) {
      dropped = true;
      const slim = conv.map((m) => m.images ? Object.assign({}, m, { images: m.images.map((i) => ({ name: i.name, dropped: true })) }) : m);
      try { localStorage.setItem(CONV, JSON.stringify(slim)); } catch (e2) { localStorage.removeItem(CONV); }
    }
    showNotice(dropped ? "The images of this conversation are too large for the browser's storage: the conversation is kept without them, so after a reload they are gone (and not sent again)." : "");
  }
  function showNotice(msg) { const n = $("notice"); n.textContent = msg || ""; n.hidden = !msg; }

  // -- API (same origin, JSON; the key once asked for is kept in localStorage)
  function headers() {
    const h = { "Content-Type": "application/json" };
    const k = localStorage.getItem(KEY);
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }
  async function api(path, init, retried) {
    const r = await fetch(path, Object.assign({ headers: headers() }, init || {}));
    if (r.status === 401 && !retried) {
      const k = window.prompt("This server needs its API key (--api-key):");
      if (k) { localStorage.setItem(KEY, k.trim()); return api(path, Object.assign({}, init, { headers: headers() }), true); }
    }
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { msg = (await r.json()).error.message || msg; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    return r;
  }
  function showError(msg) { const e = $("error"); e.textContent = msg || ""; e.hidden = !msg; }

  // -- rendering
  function renderMessage(m) {
    const box = el("div", "msg " + m.role);
    box.appendChild(el("div", "role", m.role));
    if (m.reasoning) {
      const d = el("details", "reasoning-box");
      d.appendChild(el("summary", null, "reasoning"));
      d.appendChild(el("div", "reasoning", m.reasoning));
      box.appendChild(d);
    }
    if (m.images && m.images.length) {
      const row = el("div", "images");
      for (const im of m.images) {
        if (isImageUrl(im.url)) {
          const img = el("img", "thumb");
          img.alt = im.name || "image";
          img.src = im.url;
          row.appendChild(img);
        } else row.appendChild(el("div", "image-dropped", "[image " + (im.name || "") + " not kept: too large for the browser's storage]"));
      }
      box.appendChild(row);
    }
    const body = el("div", "content");
    body.appendChild(renderMarkdown(m.content || ""));
    box.appendChild(body);
    for (const c of m.tool_calls || []) box.appendChild(el("div", "tool", "tool call: " + c.function.name + "(" + c.function.arguments + ")"));
    if (m.meta) box.appendChild(el("div", "meta", m.meta));
    return box;
  }
  function renderAll() {
    const list = $("messages");
    list.replaceChildren(...conv.map(renderMessage));
    list.scrollTop = list.scrollHeight;
    $("regenerate").disabled = !!controller || !conv.some((m) => m.role === "user");
  }
  function busy(on) { $("send").disabled = on; $("stop").disabled = !on; $("regenerate").disabled = on; }

  // -- chat
  function requestBody() {
    const messages = [];
    if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
    for (const m of conv) {
      const out = { role: m.role, content: m.content || "" };
      const imgs = (m.images || []).filter((i) => isImageUrl(i.url));
      if (imgs.length) {  // OpenAI content parts: the images, then the text
        out.content = imgs.map((i) => ({ type: "image_url", image_url: { url: i.url } }));
        if (m.content) out.content.push({ type: "text", text: m.content });
      }
      if (m.tool_calls && m.tool_calls.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
    const body = { model: modelId || "default", messages, stream: true, stream_options: { include_usage: true } };
    if (settings.temperature !== "") body.temperature = Number(settings.temperature);
    if (settings.maxTokens !== "") body.max_tokens = parseInt(settings.maxTokens, 10);
    return body;
  }
  async function generate() {
    showError("");
    const body = requestBody();
    const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
    conv.push(msg);
    controller = new AbortController();
    busy(true);
    renderAll();
    const t0 = performance.now();
    let usage = null, finish = null;
    try {
      const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
          if (!data || data === "[DONE]") continue;
          const ev = JSON.parse(data);
          if (ev.error) throw new Error(ev.error.message || "error");
          if (ev.usage) usage = ev.usage;
          for (const ch of ev.choices || []) {
            const d = ch.delta || {};
            if (d.content) msg.content += d.content;
            if (d.reasoning_content) msg.reasoning += d.reasoning_content;
            for (const tc of d.tool_calls || []) {
              const slot = msg.tool_calls[tc.index] || (msg.tool_calls[tc.index] = { id: tc.id, type: "function", function: { name: "", arguments: "" } });
              if (tc.function && tc.function.name) slot.function.name += tc.function.name;
              if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
            }
            if (ch.finish_reason) finish = ch.finish_reason;
          }
          updateLast(msg);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else showError(String(e.message || e));
    } finally {
      controller = null;
      busy(false);
    }
    const secs = (performance.now() - t0) / 1000;
    const parts = [];
    if (finish) parts.push(finish);
    if (usage) {
      parts.push(usage.completion_tokens + " tokens, " + (usage.completion_tokens / secs).toFixed(1) + " tok/s");
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push("prompt " + usage.prompt_tokens + " (" + cached + " cached)");
    }
    msg.meta = parts.join(" · ");
    pending = null;
    if (!msg.tool_calls.length) delete msg.tool_calls;
    save();
    renderAll();
    refreshStats();
  }
  let pending = null;  // the streamed message is redrawn at most once a frame
  function updateLast(msg) {
    if (pending === null) requestAnimationFrame(() => { const m = pending; pending = null; if (m) drawLast(m); });
    pending = msg;
  }
  function drawLast(msg) {
    const list = $("messages");
    const node = renderMessage(msg);
    if (list.lastChild) list.replaceChild(node, list.lastChild); else list.appendChild(node);
    list.scrollTop = list.scrollHeight;
  }
  function send() {
    const text = $("input").value;
    if ((!text.trim() && !attached.length) || controller) return;
    $("input").value = "";
    const m = { role: "user", content: text };
    if (attached.length) m.images = attached;
    attached = [];
    renderAttachments();
    conv.push(m);
    save();
    generate();
  }

  // -- image attach (shown only when /v1/models says the model takes images)
  function isImageUrl(u) { return typeof u === "string" && /^data:image\/(png|jpeg|webp|gif);base64,[A-Za-z0-9+/=]*$/.test(u); }
  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r.readAsDataURL(file);
    });
  }
  async function attachFiles(files) {
    if (!vision) return;
    for (const f of files) {
      const url = await readDataUrl(f).catch(() => null);
      if (!isImageUrl(url)) { showError(f.name + ": not a PNG, JPEG, WebP or GIF image"); continue; }
      attached.push({ name: f.name, url });
    }
    renderAttachments();
  }
  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren(...attached.map((a, i) => {
      const item = el("div", "attachment");
      const img = el("img", "thumb");
      img.alt = a.name;
      img.src = a.url;
      const rm = el("button", null, "×");
      rm.type = "button";
      rm.title = "remove " + a.name;
      rm.addEventListener("click", () => { attached.splice(i, 1); renderAttachments(); });
      item.append(img, rm);
      return item;
    }));
    box.hidden = !attached.length;
  }
  function regenerate() {
    if (controller) return;
    while (conv.length && conv[conv.length - 1].role !== "user") conv.pop();
    if (conv.length) generate();
  }

  // -- /stats
  function fmtBytes(n) { return n == null ? "–" : (n / 1073741824).toFixed(2) + " GiB"; }
  async function refreshStats() {
    if ($("stats").hidden) return;
    try {
      const s = await (await api("/stats")).json();
      const pc = s.prompt_cache || {}, plan = s.memory_plan || {}, rq = s.requests || {}, rec = s.recent || {};
      const rows = [
        ["model", s.model],
        ["generation tok/s", rec.generation_tokens_per_second ?? "–"],
        ["prompt tok/s", rec.prompt_tokens_per_second ?? "–"],
        ["context ceiling", s.context_tokens + " tokens"],
        ["weights", fmtBytes(plan.weightsBytes)],
        ["memory budget", fmtBytes(plan.usableBytes)],
        ["active", rq.active], ["queued", rq.queued],
        ["served", rq.served], ["cancelled", rq.cancelled],
        ["prefix cache hits", (pc.hits ?? 0) + " / " + ((pc.hits ?? 0) + (pc.misses ?? 0))],
        ["prefix cache", (pc.entries ?? 0) + " entries, " + fmtBytes(pc.bytes)],
        ["cached prompt tokens", (s.tokens || {}).cached],
      ];
      const dl = $("stats-list");
      dl.replaceChildren();
      for (const [k, v] of rows) {
        const dt = el("dt", null, k), dd = el("dd", null, String(v));
        dd.dataset.stat = k;
        dl.append(dt, dd);
      }
    } catch (e) { showError("stats: " + (e.message || e)); }
  }

  // -- wiring
  function init() {
    $("system").value = settings.system;
    $("temperature").value = settings.temperature;
    $("max-tokens").value = settings.maxTokens;
    $("system").addEventListener("input", (e) => { settings.system = e.target.value; save(); });
    $("temperature").addEventListener("input", (e) => { settings.temperature = e.target.value; save(); });
    $("max-tokens").addEventListener("input", (e) => { settings.maxTokens = e.target.value; save(); });
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
    $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
    $("regenerate").addEventListener("click", regenerate);
    $("new").addEventListener("click", () => { if (controller) controller.abort(); conv = []; save(); renderAll(); });
    $("attach").addEventListener("click", () => $("attach-input").click());
    $("attach-input").addEventListener("change", (e) => { const files = Array.from(e.target.files); e.target.value = ""; attachFiles(files); });
    // an image pasted into the input, or dropped on the composer, is attached too (a model that takes images)
    const imageFiles = (dt) => Array.from((dt && dt.files) || []).filter((f) => f.type.startsWith("image/"));
    $("input").addEventListener("paste", (e) => {
      const files = imageFiles(e.clipboardData);
      if (vision && files.length) { e.preventDefault(); attachFiles(files); }
    });
    $("composer").addEventListener("dragover", (e) => { if (vision) e.preventDefault(); });
    $("composer").addEventListener("drop", (e) => {
      const files = imageFiles(e.dataTransfer);
      if (vision && files.length) { e.preventDefault(); attachFiles(files); }
    });
    $("toggle-settings").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
    $("toggle-stats").addEventListener("click", () => { $("stats").hidden = !$("stats").hidden; refreshStats(); });
    $("forget-key").addEventListener("click", () => localStorage.removeItem(KEY));
    setInterval(refreshStats, 3000);
    renderAll();
    api("/v1/models").then((r) => r.json()).then((d) => {
      const card = d.data[0];
      vision = (card.input_modalities || []).includes("image");
      $("attach").hidden = !vision;
      modelId = card.id;
      $("model").textContent = modelId;
    })
      .catch((e) => showError(String(e.message || e)));
  }
  window.mlxrsChat = { renderMarkdown };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
