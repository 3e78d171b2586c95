// The page's conversation over /api/chat (Moshi's framing: a kind byte, then the payload): the microphone in 80 ms
// blocks of 24 kHz audio (PCM16, or Ogg/Opus through opus.js), the reply played as it comes, both voices drawn on
// one scrolling time axis with each turn's marks, and the exchange kept for a stereo WAV (left: you, right: model).
// A model with a text stream (Moshi's inner monologue, kind 2 messages) has its text shown under its lane, each word
// where its audio plays, and in full below the picture.
// Time is the AudioContext's clock, in seconds from the start of the conversation.
import { OpusReceiver, OpusSender } from "/web/opus.js";

const RATE = 24000, BLOCK = 1920, BLOCK_S = BLOCK / RATE;
const SLOT_S = 0.02;  // the waveform's resolution
const WINDOW_S = 10;  // seconds of the scrolling picture
const SPEECH_RMS = 0.02, QUIET_BLOCKS = 4;  // the page's own end of speech: 320 ms under this level
const AUDIBLE_RMS = 0.003;  // model audio above this counts as a reply
const $ = (id) => document.getElementById(id);

const state = window.s2s = { connected: false, handshake: false, sentBlocks: 0, receivedSamples: 0, micPeak: 0,
  errors: [], problem: null, turns: [], url: null, metadata: null, status: "", text: "" };
let conv = null;  // the live conversation's parts

// ---- settings -------------------------------------------------------------------------------------------------

async function loadSettings() {
  const page = new URLSearchParams(location.search);
  for (const name of ["mode", "codec"]) {
    const want = page.get(name);
    const radio = want && document.querySelector(`input[name=${name}][value="${CSS.escape(want)}"]`);
    if (radio) radio.checked = true;
  }
  try {
    const settings = await (await fetch("/api/voices", { signal: AbortSignal.timeout(10000) })).json();
    for (const name of settings.voices) $("voice").append(new Option(name, name));
    offerModes(settings.modes ?? ["turn", "duplex"]);
    for (const [key, value] of Object.entries(settings.sampling)) $(key).placeholder = `default ${value}`;
    $("top_k").max = settings.max_top_k;
    $("token").hidden = $("token-label").hidden = !settings.token_required;
  } catch (e) {
    problem(`Could not read the server's settings: ${e}`);
  }
  for (const key of ["voice", "temperature", "top_k", "top_p", "seed", "token"]) if (page.has(key)) $(key).value = page.get(key);
}

let modesOffered = ["turn", "duplex"];

function offerModes(modes) {  // a model with a text stream (Moshi's) holds duplex conversations only
  modesOffered = modes;
  const radios = [...document.querySelectorAll("input[name=mode]")];
  for (const radio of radios) radio.disabled = !modes.includes(radio.value);
  if (radios.some((r) => r.checked && r.disabled)) radios.find((r) => !r.disabled).checked = true;
}

// Start waits for this (and is off until it settles): the page's query, its token among it, is in the form only then.
const settingsRead = loadSettings().catch((e) => problem(`Could not read the page's settings: ${e}`))
  .finally(() => { $("start").disabled = false; });

function query() {
  const form = new FormData($("settings"));
  const q = new URLSearchParams();
  for (const [key, value] of form) if (String(value).trim() !== "") q.set(key, String(value).trim());
  return q;
}

// ---- the conversation -------------------------------------------------------------------------------------------

async function start() {
  await settingsRead;
  clearProblem();
  if (!window.isSecureContext) {
    throw new Error("the browser gives a page its microphone only over https or on localhost: open it on the " +
      "server's machine, or serve it with --ssl-certfile and --ssl-keyfile");
  }
  const q = query(), mode = q.get("mode"), codec = q.get("codec");
  if (codec === "opus" && (typeof AudioEncoder === "undefined" || typeof AudioDecoder === "undefined")) {
    throw new Error("this browser has no WebCodecs for Opus: choose PCM16");
  }
  const ctx = new AudioContext({ sampleRate: RATE });  // the browser resamples the microphone to 24 kHz
  let stream;
  try {
    await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([WORKLET], { type: "text/javascript" })));
    stream = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
  } catch (e) {
    ctx.close();
    throw e;
  }
  const node = new AudioWorkletNode(ctx, "capture");
  ctx.createMediaStreamSource(stream).connect(node);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  state.url = `${scheme}://${location.host}/api/chat?${q}`;
  const ws = new WebSocket(state.url);
  ws.binaryType = "arraybuffer";
  const c = conv = { ws, ctx, stream, node, mode, codec, t0: ctx.currentTime, playAt: 0, you: [], model: [], youEnv: [],
    modelEnv: [], marks: [], audible: [], words: [], speaking: false, quiet: 0, lastLoud: null, opened: false,
    userStop: false, refused: null };
  state.text = "";
  $("model-text-body").textContent = ""; $("model-text").hidden = true;
  const onError = (text) => note(`audio: ${text}`);
  if (codec === "opus") {
    c.sender = new OpusSender((page) => send(c, page), { onError });
    c.receiver = new OpusReceiver((pcm) => c === conv && play(pcm), { onError });
  }
  // each handler acts on its own conversation only: a late event of a stopped one changes nothing
  ws.onopen = () => { if (c === conv) { c.opened = state.connected = true; status(`Connected (${mode}, ${codec}). Speak.`); } };
  ws.onclose = (ev) => { if (c === conv) closed(ev); };
  ws.onmessage = (ev) => { if (c === conv) receive(new Uint8Array(ev.data)); };
  node.port.onmessage = (ev) => { if (c === conv) heard(ev.data); };
  $("start").disabled = true; $("stop").disabled = false; $("done").disabled = mode !== "turn";
  setDisabled($("settings"), true);
  status("Connecting...");
  requestAnimationFrame(() => draw(c));
}

function send(c, payload) {
  if (c.ws.readyState !== WebSocket.OPEN) return;
  const out = new Uint8Array(1 + payload.length);
  out[0] = 1; out.set(payload, 1);
  c.ws.send(out);
}

function heard(block) {  // 80 ms of the microphone
  const now = clock(), rms = level(block);
  conv.you.push(block);
  envelope(conv.youEnv, now - BLOCK_S, block);
  state.micPeak = Math.max(state.micPeak, ...block.map(Math.abs));
  $("you-level").value = rms;
  if (rms > SPEECH_RMS) {
    if (!conv.speaking && playing()) cutReply(now - BLOCK_S);  // talking over the reply: a barge-in
    conv.speaking = true; conv.quiet = 0; conv.lastLoud = now;
  } else if (conv.speaking && ++conv.quiet >= QUIET_BLOCKS) {
    conv.speaking = false;
    addTurn(conv.lastLoud);
  }
  if (conv.ws.readyState !== WebSocket.OPEN) return;
  if (conv.sender) conv.sender.push(block);
  else send(conv, new Uint8Array(pcm16(block).buffer));
  state.sentBlocks++;
}

function receive(msg) {
  const kind = msg[0], body = msg.subarray(1);
  if (kind === 0) state.handshake = true;
  else if (kind === 1) conv.receiver ? conv.receiver.push(body) : play(fromPcm16(body));
  else if (kind === 2) text(new TextDecoder().decode(body));
  else if (kind === 4) event(JSON.parse(new TextDecoder().decode(body)));
  else if (kind === 5) serverError(new TextDecoder().decode(body));
}

function play(pcm) {  // reply audio, played back to back from when it comes
  if (!pcm.length) return;
  const { ctx } = conv, now = clock();
  if (level(pcm) > AUDIBLE_RMS) {
    conv.audible.push(now);
    if (conv.audible.length > 64) conv.audible.shift();
    firstAudio(now);
  }
  const buffer = ctx.createBuffer(1, pcm.length, RATE);
  buffer.getChannelData(0).set(pcm);
  const src = ctx.createBufferSource();
  src.buffer = buffer; src.connect(ctx.destination);
  conv.playAt = Math.max(conv.playAt, ctx.currentTime + 0.05);
  src.start(conv.playAt);
  const at = conv.playAt - conv.t0;
  conv.model.push([Math.round(at * RATE), pcm]);
  envelope(conv.modelEnv, at, pcm);
  conv.playAt += buffer.duration;
  $("model-level").value = level(pcm);
  state.receivedSamples += pcm.length;
}

function text(piece) {  // the model's text: a piece of its step, sent after that step's audio
  if (!piece) return;
  const at = Math.max(clock(), conv.playAt - conv.t0 - BLOCK_S);  // where that audio plays
  const last = conv.words.at(-1);
  if (last && !/^\s/.test(piece)) last.text += piece;  // a piece within a word
  else conv.words.push({ t: at, text: piece.trim() });
  if (conv.words.length > 400) conv.words.shift();
  state.text += piece;
  $("model-text-body").textContent = state.text.trim();
  $("model-text").hidden = false;
  $("model-text").scrollTop = $("model-text").scrollHeight;
}

function event(data) {
  if (!state.metadata) state.metadata = data;  // the first: the conversation's own
  if (data.event === "reply_done") endReply(clock());
  else if (data.event === "error") note(data.message);
}

function serverError(text) {
  state.errors.push(text);
  if (text.startsWith("refused")) {
    conv.refused = text;
    refusedNow(text);
  } else note(text);
}

function refusedNow(text) {  // "refused: REASON", told after the upgrade or in the body of the HTTP answer to it
  problem(`The server cannot take this conversation now (${text.replace(/^refused:\s*/, "")}). Try again soon.`);
}

async function closed(ev) {
  state.connected = false;
  const { opened, userStop, refused } = conv;
  finish();
  if (userStop || refused) return;
  if (opened) return problem(`Connection lost (${ev.code}${ev.reason ? ": " + ev.reason : ""}).`);
  let why = "Could not connect to the server.";
  try {  // a refused upgrade tells the browser nothing: ask again over plain HTTP for its status and reason
    const r = await fetch(state.url.replace(/^ws/, "http"));
    if (r.status === 401) why = "Wrong or missing token: enter the server's token and retry.";
    else if (r.status === 403) why = "This page's origin may not connect to the server.";
    else if (r.status === 429 || r.status === 503) {  // full, draining, or this client's limit: the body says which
      const text = (await r.text()).trim();
      state.errors.push(text);
      return refusedNow(text);
    }
  } catch { /* the server is not there at all */ }
  problem(why);
}

function stop() {
  if (!conv || conv.finished) return;
  conv.userStop = true;
  conv.ws.close();
  finish();
  status("Stopped.");
}

function finish() {
  if (!conv || conv.finished) return;
  conv.finished = true;
  conv.node.port.onmessage = null;
  conv.stream.getTracks().forEach((t) => t.stop());
  conv.sender?.close(); conv.receiver?.close();
  conv.ctx.close();  // what is still scheduled stops playing
  $("start").disabled = false; $("stop").disabled = true; $("done").disabled = true;
  setDisabled($("settings"), false);
  offerModes(modesOffered);
  offerWav();
}

// ---- turns: the page's own marks, on its clock ------------------------------------------------------------------

function addTurn(stopAt) {
  const turn = { n: state.turns.length + 1, stop: stopAt, first: null, latencyMs: null, end: null, cut: null };
  state.turns.push(turn);
  conv.marks.push({ t: stopAt, kind: "stop" });
  const since = conv.audible.find((t) => t >= stopAt);  // reply audio that came before the page was sure you stopped
  if (since !== undefined) firstAudio(since);
  showTurns();
}

function firstAudio(now) {
  const turn = state.turns.at(-1);
  if (!turn || turn.first !== null || turn.cut !== null) return;
  turn.first = now; turn.latencyMs = Math.round((now - turn.stop) * 1000);
  conv.marks.push({ t: now, kind: "first" });
  status(`Turn ${turn.n}: first reply audio ${turn.latencyMs} ms after you stopped.`);
  showTurns();
}

function endReply(now) {
  const turn = state.turns.findLast((t) => t.first !== null && t.end === null && t.cut === null);
  if (!turn) return;
  turn.end = Math.max(now, conv.playAt - conv.t0);  // it ends for the listener when its audio has played
  conv.marks.push({ t: turn.end, kind: "end" });
  showTurns();
}

function cutReply(now) {
  const turn = state.turns.findLast((t) => t.first !== null && t.end === null && t.cut === null);
  if (!turn) return;
  turn.cut = now;
  conv.marks.push({ t: now, kind: "cut" });
  showTurns();
}

function showTurns() {
  const s = (t) => (t === null ? "-" : t.toFixed(2));
  $("turns").tBodies[0].replaceChildren(...state.turns.map((t) => {
    const row = document.createElement("tr");
    const reply = t.cut !== null ? `cut at ${s(t.cut)} s` : t.end !== null ? `ended at ${s(t.end)} s` : t.first !== null ? "playing" : "waiting";
    for (const cell of [t.n, s(t.stop), s(t.first), t.latencyMs ?? "-", reply]) {
      const td = document.createElement("td"); td.textContent = cell; row.append(td);
    }
    return row;
  }));
}

// ---- the live picture ------------------------------------------------------------------------------------------

function envelope(env, at, pcm) {  // the peak of each 20 ms slot
  const per = Math.round(SLOT_S * RATE);
  for (let i = 0; i < pcm.length; i += per) {
    const slot = Math.floor((at + i / RATE) / SLOT_S);
    let peak = 0;
    for (let j = i; j < Math.min(i + per, pcm.length); j++) peak = Math.max(peak, Math.abs(pcm[j]));
    env[slot] = Math.max(env[slot] ?? 0, peak);
  }
}

function draw(c) {
  if (c !== conv) return;
  const canvas = $("scope"), g = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  const strip = c.words.length ? 20 : 0, mid = (h - strip) / 2;  // the model's text under its lane
  const now = clock(), from = Math.max(0, now - WINDOW_S), x = (t) => ((t - from) / WINDOW_S) * w;
  g.clearRect(0, 0, w, h);
  g.fillStyle = "#e5e5e0"; g.fillRect(0, mid, w, 1);
  const lane = (env, color, base, dir) => {
    g.fillStyle = color;
    for (let slot = Math.floor(from / SLOT_S); slot * SLOT_S <= now; slot++) {
      const db = 20 * Math.log10((env[slot] ?? 0) + 1e-9);  // -60 dBFS at the axis, 0 dBFS at the edge
      const v = Math.max(0, Math.min(1, (db + 60) / 60)) * (mid - 6);
      g.fillRect(x(slot * SLOT_S), dir > 0 ? base : base - v, Math.max(1, w * SLOT_S / WINDOW_S), v);
    }
  };
  lane(conv.youEnv, "#1f5fa8", mid - 2, -1);
  lane(conv.modelEnv, "#a8431f", mid + 2, 1);
  const colors = { stop: "#1f5fa8", first: "#1b7a2e", end: "#555", cut: "#b00" };
  for (const m of conv.marks.filter((m) => m.t >= from)) { g.fillStyle = colors[m.kind]; g.fillRect(x(m.t) - 1, 0, 3, h); }
  g.fillStyle = "#333"; g.font = "13px system-ui";
  g.fillText("you", 6, 16); g.fillText("model", 6, h - strip - 8);
  g.fillText(`${now.toFixed(1)} s`, w - 60, 16);
  if (strip) {
    g.fillStyle = "#e5e5e0"; g.fillRect(0, h - strip, w, 1);
    g.fillStyle = "#a8431f";
    let right = -Infinity;  // words that would overlap move right
    for (const word of c.words.filter((word) => word.t >= from - 2)) {
      const at = Math.max(x(word.t), right + 4);
      g.fillText(word.text, at, h - 5);
      right = at + g.measureText(word.text).width;
    }
  }
  if (!conv.finished) requestAnimationFrame(() => draw(c));
}

// ---- the recording ------------------------------------------------------------------------------------------------

function offerWav() {
  const you = concat(conv.you);
  const end = conv.model.reduce((m, [at, pcm]) => Math.max(m, at + pcm.length), you.length);
  const model = new Float32Array(end);
  for (const [at, pcm] of conv.model) model.set(pcm.subarray(0, Math.max(0, end - at)), at);
  const wav = new DataView(new ArrayBuffer(44 + end * 4));
  const text = (at, s) => [...s].forEach((c, i) => wav.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); wav.setUint32(4, 36 + end * 4, true); text(8, "WAVEfmt ");
  wav.setUint32(16, 16, true); wav.setUint16(20, 1, true); wav.setUint16(22, 2, true); wav.setUint32(24, RATE, true);
  wav.setUint32(28, RATE * 4, true); wav.setUint16(32, 4, true); wav.setUint16(34, 16, true);
  text(36, "data"); wav.setUint32(40, end * 4, true);
  for (let i = 0; i < end; i++) {
    wav.setInt16(44 + 4 * i, clip16(you[i] ?? 0), true);
    wav.setInt16(46 + 4 * i, clip16(model[i]), true);
  }
  const link = $("download");
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(new Blob([wav], { type: "audio/wav" }));
  link.setAttribute("aria-disabled", "false");
  state.wavSeconds = end / RATE;
}

// ---- small parts --------------------------------------------------------------------------------------------------

const WORKLET = `class Capture extends AudioWorkletProcessor {
  constructor() { super(); this.buf = new Float32Array(${BLOCK}); this.n = 0; }
  process(inputs) {
    const ch = inputs[0][0];
    if (ch) for (let i = 0; i < ch.length; i++) {
      this.buf[this.n++] = ch[i];
      if (this.n === ${BLOCK}) { this.port.postMessage(this.buf.slice()); this.n = 0; }
    }
    return true;
  }
}
registerProcessor("capture", Capture);`;

const clock = () => conv.ctx.currentTime - conv.t0;
const playing = () => conv.playAt > conv.ctx.currentTime;
const level = (pcm) => Math.sqrt(pcm.reduce((s, v) => s + v * v, 0) / Math.max(1, pcm.length));
const clip16 = (v) => Math.max(-32768, Math.min(32767, Math.round(v * 32767)));
const pcm16 = (f) => Int16Array.from(f, clip16);
const fromPcm16 = (bytes) => Float32Array.from(new Int16Array(bytes.slice(0, bytes.length & ~1).buffer), (v) => v / 32768);
const concat = (chunks) => { const out = new Float32Array(chunks.reduce((n, c) => n + c.length, 0)); let at = 0;
  for (const c of chunks) { out.set(c, at); at += c.length; } return out; };
const setDisabled = (form, disabled) => form.querySelectorAll("input, select").forEach((e) => { e.disabled = disabled; });

function status(text) { state.status = text; $("status").textContent = text; }
function note(text) { state.errors.push(text); status(`Server: ${text}`); }
function problem(text) { state.problem = text; $("problem-text").textContent = text; $("problem").hidden = false; $("retry").focus(); }
function clearProblem() { state.problem = null; $("problem").hidden = true; }

$("start").onclick = () => start().catch((e) => problem(`Could not start: ${e.message ?? e}`));
$("retry").onclick = $("start").onclick;
$("stop").onclick = stop;
$("done").onclick = () => {  // the user says they are done: a turn ends now, not at the page's own end of speech
  if (conv?.ws.readyState !== WebSocket.OPEN) return;
  conv.speaking = false;
  addTurn(clock());
  conv.ws.send(new Uint8Array([3, 1]));
};
window.s2sStart = () => start();
window.s2sStop = () => stop();
