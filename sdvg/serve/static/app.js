// sdvg serve page: plain JS, no build step. Speaks Krea's protocol with sdvg's superset (?sdvg=1).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const token = new URLSearchParams(location.search).get("token");
  const enc = new TextEncoder();

  // a small msgpack encoder: maps, strings, numbers, booleans, null, byte arrays
  function pack(value, out) {
    const u8 = (b) => out.push(b & 0xff);
    const u32 = (v) => out.push((v >>> 24) & 0xff, (v >>> 16) & 0xff, (v >>> 8) & 0xff, v & 0xff);
    if (value === null || value === undefined) u8(0xc0);
    else if (value === true) u8(0xc3);
    else if (value === false) u8(0xc2);
    else if (typeof value === "number") {
      if (Number.isInteger(value) && value >= 0 && value < 2 ** 32) {
        if (value < 128) u8(value); else { u8(0xce); u32(value); }
      } else if (Number.isInteger(value) && value < 0 && value >= -(2 ** 31)) {
        u8(0xd2); u32(value >>> 0);
      } else {
        u8(0xcb); const b = new DataView(new ArrayBuffer(8)); b.setFloat64(0, value);
        for (let i = 0; i < 8; i++) out.push(b.getUint8(i));
      }
    } else if (typeof value === "string") {
      const s = enc.encode(value);
      if (s.length < 32) u8(0xa0 | s.length); else { u8(0xdb); u32(s.length); }
      for (const b of s) out.push(b);
    } else if (value instanceof Uint8Array) {
      u8(0xc6); u32(value.length); for (const b of value) out.push(b);
    } else if (typeof value === "object") {
      const keys = Object.keys(value).filter((k) => value[k] !== undefined);
      u8(0xdf); u32(keys.length);
      for (const k of keys) { pack(k, out); pack(value[k], out); }
    } else throw new Error("cannot pack " + typeof value);
    return out;
  }
  const msg = (obj) => new Uint8Array(pack(obj, []));
  const withToken = (url) =>  // a token in the page's own address (a cookie from /?token= needs none)
    (token ? url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : url);

  const canvas = $("canvas"), ctx = canvas.getContext("2d"), data = document.body.dataset;
  const setStatus = (s) => { $("status").textContent = s; };
  const show = (id, v) => { $(id).textContent = v; };

  // The player: frames are decoded in order into a jitter buffer and drawn one at a time at the video's frame
  // rate (never a block at once); playback starts once JITTER frames wait (or the run has ended) and waits again
  // when the buffer runs dry. Its clock is `window.sdvgClock` (the browser test replaces it).
  window.sdvgClock = () => performance.now();
  const JITTER = 4;
  const player = { queue: [], decoding: Promise.resolve(), run: 0, playing: false, ended: false, last: null,
                   drawn: 0, first: null, recent: [], frameMs: 1000 / 16, underruns: 0 };
  function resetPlayer() {
    player.run += 1;  // frames still decoding for an earlier run are dropped
    player.queue.forEach((img) => img.close && img.close());
    Object.assign(player, { queue: [], playing: false, ended: false, last: null, drawn: 0, first: null, recent: [],
                            underruns: 0 });
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    data.framesDrawn = 0; data.maxDrawsPerTick = 0; data.achievedFps = 0; data.underruns = 0;
    show("drawn", 0); show("buffered", 0); show("fps", "0");
  }
  function receive(blob) {
    const run = player.run;
    player.decoding = player.decoding.then(() => createImageBitmap(blob)).then((img) => {
      if (run !== player.run) { img.close(); return; }
      player.queue.push(img); show("buffered", player.queue.length);
    }, () => {});
  }
  function tick() {
    const now = window.sdvgClock();
    let draws = 0;
    if (!player.playing && player.queue.length && (player.queue.length >= JITTER || player.ended)) {
      player.playing = true;
    }
    if (player.playing && player.queue.length && (player.last === null || now - player.last >= player.frameMs - 0.5)) {
      const img = player.queue.shift();
      if (canvas.width !== img.width) { canvas.width = img.width; canvas.height = img.height; }
      ctx.drawImage(img, 0, 0);
      img.close();
      draws = 1;
      // a steady cadence; after a stall (or a clock that jumped) the next frame is timed from now
      player.last = player.last === null || now - player.last > 2 * player.frameMs ? now : player.last + player.frameMs;
      player.drawn += 1; player.first = player.first === null ? now : player.first;
      player.recent.push(now);
      while (player.recent.length && now - player.recent[0] > 2000) player.recent.shift();
      data.framesDrawn = player.drawn; show("drawn", player.drawn); show("buffered", player.queue.length);
      const span = now - player.recent[0];  // the rate over the last 2 s of playback
      show("fps", span > 0 ? ((player.recent.length - 1) * 1000 / span).toFixed(1) : "-");
      if (player.drawn > 1) data.achievedFps = ((player.drawn - 1) * 1000 / (now - player.first)).toFixed(2);
    }
    data.maxDrawsPerTick = Math.max(Number(data.maxDrawsPerTick || 0), draws);
    if (player.playing && !player.queue.length && !player.ended) {  // dry mid-run: buffer again
      player.playing = false; player.underruns += 1; data.underruns = player.underruns;
    }
    requestAnimationFrame(tick);
  }
  requestAnimationFrame(tick);

  // The session: phase "idle" | "starting" (parameters sent, not yet taken) | "running" | "done"
  let ws = null, sessionId = null, downloadUrl = null, phase = "idle", received = 0, pendingBlend = 4;
  let awaitingReset = false;
  function controls() {
    const open = ws && ws.readyState === 1;
    $("start").disabled = phase === "starting" || phase === "running";
    $("stop").disabled = !(phase === "starting" || phase === "running");
    $("apply").disabled = !(open && phase === "running");
    $("reset").disabled = !(open && (phase === "running" || phase === "done"));
    $("download").disabled = !(downloadUrl && received > 0 && phase !== "starting");
  }
  function clearRun() {  // what a new run starts without
    received = 0; data.framesReceived = 0; show("frames", 0); $("blocks").textContent = ""; show("latency", "-"); show("acceptance", "-");
    delete data.lastError; delete data.lastAck;
    resetPlayer();
  }
  function endRun(status) {
    phase = "done"; player.ended = true; closeCamera(); setStatus(status); controls();
  }
  $("blend").oninput = () => { show("blendValue", $("blend").value); };
  $("tau").oninput = () => { show("tauValue", $("tau").value); };
  $("tau").onchange = () => { if (ws && ws.readyState === 1 && phase === "running") ws.send(msg({ tau: Number($("tau").value) })); };
  $("strength").oninput = () => { show("strengthValue", $("strength").value); };

  // Webcam (Krea's webcam_mode): camera frames as JPEG `image` messages at 16 frames/s while the session holds
  // a slot; the server queues them for the blocks to come (block 0 reads 9, each later block 12)
  const FRAME_MS = 1000 / 16, camera = $("camera"), grab = document.createElement("canvas");
  let stream = null, capture = null, sent = 0;
  async function openCamera() {
    stream = await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: 640 }, height: { ideal: 480 } },
                                                         audio: false });
    camera.srcObject = stream;
    await camera.play();
  }
  function startCapture() {
    if (!stream || capture) return;
    capture = setInterval(() => {
      if (!ws || ws.readyState !== 1 || !camera.videoWidth) return;
      if (ws.bufferedAmount > 4 * 1024 * 1024) return;  // the socket is behind: this frame is skipped
      grab.width = camera.videoWidth; grab.height = camera.videoHeight;
      grab.getContext("2d").drawImage(camera, 0, 0);
      grab.toBlob((blob) => blob && blob.arrayBuffer().then((buf) => {
        if (!ws || ws.readyState !== 1 || !capture) return;
        ws.send(msg({ image: new Uint8Array(buf) }));
        sent += 1; show("framesSent", sent); data.webcamFramesSent = sent;
      }), "image/jpeg", 0.85);
    }, FRAME_MS);
  }
  function closeCamera() {
    clearInterval(capture); capture = null;
    if (stream) stream.getTracks().forEach((t) => t.stop());
    stream = null; camera.srcObject = null;
  }

  // Uploads (Krea's start_frame and input_video): posted when Start is pressed, their ids sent in the parameters
  async function uploadFile(input, route) {
    const file = $(input).files[0];
    if (!file) return null;
    const form = new FormData();
    form.append("file", file, file.name);
    const r = await fetch(withToken(route), { method: "POST", body: form });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || "HTTP " + r.status);
    return body.id;
  }

  function ackText(m) {
    if (m.field === "prompt" && m.block !== null) {
      const n = pendingBlend;  // Krea's blend: weights linspace(0, 1, n), the first block's 0
      if (n === 1) return "the new prompt from block " + m.block;
      return "the new prompt blends in from block " + (m.block + 1) + " (block " + m.block + " at weight 0.00), " +
        "whole from block " + (m.block + n - 1);
    }
    if (m.block === null) return m.field + " takes effect at the " + (m.effective || "next run");
    if (m.action === "reset") return "reset: the run restarts at block 0";
    return m.field + " takes effect at block " + m.block;
  }

  function onText(m) {
    if (m.status === "ready") {
      setStatus("ready");
      player.frameMs = 1000 / (m.fps || 16); show("videoFps", m.fps || 16);
      downloadUrl = m.download_url || "/download_video/" + sessionId;
      $("notice").hidden = !m.random_weights;
      $("notice").textContent = m.random_weights ? "Preset " + m.preset + " has random weights: its videos are " +
        "noise (load real weights, e.g. --preset wan2.1, for real videos)." : "";
      data.randomWeights = m.random_weights ? "1" : "0";
      ws.send(msg(start));
      phase = "starting"; controls();
    } else if (m.status === "queued") setStatus("queued, position " + m.position);
    else if (m.status === "params" || m.status === "running") {
      if (m.status === "params") {
        phase = "running";
        setStatus((m.state === "queued" ? "queued" : "generating") + " (seed " + m.seed + ")");
        data.strength = m.options.strength;
        const sf = m.start_frame ? m.start_frame.width + "x" + m.start_frame.height : "";
        show("startFrameInfo", sf ? "from a " + sf + " start frame" : "");
        data.startFrame = sf;
      } else setStatus("generating");
      if (m.status === "running" || m.state === "running") startCapture();
      controls();
    } else if (m.status === "stats") {
      const line = document.createElement("div");
      line.className = m.decision; line.dataset.decision = m.decision;
      line.textContent = "block " + m.block + ": " + m.decision + " score " +
        (m.score === null ? "-" : m.score.toFixed(3)) + " (" + m.producer + ")";
      if (m.prompt_index !== undefined) {  // a live session's block: the prompt it was made under, blend weight
        line.dataset.promptIndex = m.prompt_index; line.dataset.blendWeight = m.blend_weight;
        line.textContent += " prompt " + m.prompt_index + (m.blend_weight < 1 ? " (blend " + m.blend_weight.toFixed(2) + ")" : "");
      }
      $("blocks").appendChild(line);
      show("latency", (m.latency_s * 1000).toFixed(0));
      show("acceptance", m.acceptance === null ? "-" : m.acceptance.toFixed(2));
    } else if (m.status === "ack") {
      if (m.action === "reset") { awaitingReset = false; clearRun(); phase = "running"; controls(); }
      setStatus(ackText(m));
      data.lastAck = m.field + ":" + m.block;
    } else if (m.status === "error") {
      data.lastError = m.error;
      if (phase === "starting") {  // the parameters were refused: nothing runs; Start again once fixed
        setStatus("refused: " + m.error);
        phase = "idle"; const old = ws; ws = null; old.close(); controls();
      } else if (/^(could not start|generation failed|busy)/.test(m.error)) endRun("error: " + m.error);
      else setStatus("error: " + m.error);  // a refused update: the run goes on
    } else if (m.status === "completed") {
      endRun("completed");
    }
  }

  let start = null;  // the parameters of the session being opened
  $("start").onclick = async () => {
    sessionId = "page-" + Math.random().toString(36).slice(2, 12);
    if (ws) { const old = ws; ws = null; old.close(); }  // a finished session's socket (the server keeps it open)
    clearRun(); closeCamera(); sent = 0; show("framesSent", 0);
    downloadUrl = null; show("startFrameInfo", ""); show("inputVideoInfo", ""); delete data.startFrame;
    phase = "starting"; controls();  // until the parameters are taken (the uploads and the camera come first)
    const failed = (what, err) => {
      setStatus(what + ": " + err.message); data.lastError = what + ": " + err.message;
      phase = "idle"; closeCamera(); controls();
    };
    let startFrameId = null, videoId = null;
    try { startFrameId = await uploadFile("startFrame", "/upload_start_frame"); } catch (err) { failed("start frame", err); return; }
    try { videoId = await uploadFile("inputVideo", "/upload_video"); } catch (err) { failed("input video", err); return; }
    if ($("webcam").checked) {
      try { await openCamera(); } catch (err) { failed("camera", err); return; }
    }
    start = { prompt: $("prompt").value, seed: Number($("seed").value), num_blocks: Number($("numBlocks").value),
              tau: Number($("tau").value), request_id: "page" };
    if (stream) { start.webcam_mode = true; start.strength = Number($("strength").value); }
    else if (videoId) { start.input_video = videoId; start.strength = Number($("strength").value); show("inputVideoInfo", "uploaded"); }
    if (startFrameId) start.start_frame = startFrameId;
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const sock = ws = new WebSocket(scheme + location.host + withToken("/session/" + sessionId + "?sdvg=1"));
    sock.binaryType = "blob";
    // an earlier session's socket, closed or closing, no longer speaks for the page
    sock.onmessage = (e) => {
      if (sock !== ws) return;
      if (typeof e.data === "string") { onText(JSON.parse(e.data)); return; }
      if (awaitingReset) return;  // a frame of the run the reset replaced
      received += 1; show("frames", received); data.framesReceived = received;
      receive(e.data); controls();
    };
    sock.onclose = () => {
      if (sock !== ws) return;
      closeCamera(); player.ended = true;
      if (phase === "starting" || phase === "running") setStatus(phase === "starting" ? "disconnected" : "stopped");
      phase = phase === "running" ? "done" : phase === "starting" ? "idle" : phase;
      controls();
    };
  };
  $("stop").onclick = () => { if (ws) ws.close(); };  // the server finishes the video: Download stays open
  $("apply").onclick = () => {
    if (!(ws && ws.readyState === 1 && phase === "running")) return;
    pendingBlend = Number($("blend").value);
    ws.send(msg({ prompt: $("prompt").value, interp_steps: pendingBlend }));
  };
  $("reset").onclick = () => {
    if (!(ws && ws.readyState === 1)) return;
    awaitingReset = true;  // frames before the reset's ack belong to the run it replaces
    ws.send(msg({ action: "reset" }));
    setStatus("resetting");
  };
  $("download").onclick = async () => {
    // a run just stopped is still being finished (409): asked again a few times
    for (let i = 0; i < 20; i++) {
      const r = await fetch(withToken(downloadUrl));
      if (r.status === 409) { await new Promise((done) => setTimeout(done, 500)); continue; }
      if (!r.ok) { setStatus("download: HTTP " + r.status); data.lastError = "download: HTTP " + r.status; return; }
      const url = URL.createObjectURL(await r.blob());
      data.downloadedBytes = (await (await fetch(url)).blob()).size;
      const a = document.createElement("a"); a.href = url; a.download = sessionId + ".mp4";
      document.body.appendChild(a); a.click(); a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
      return;
    }
    setStatus("download: the video is still being finished; try again");
  };
  controls();
})();
