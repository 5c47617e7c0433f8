// sdvg serve page: plain JS, no build step. Speaks Krea's protocol with sdvg's superset (?sdvg=1).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const token = new URLSearchParams(location.search).get("token");
  const enc = new TextEncoder();

  // a small msgpack encoder: maps, strings, numbers, booleans, null, byte arrays
  function pack(value, out) {
    const u8 = (b) => out.push(b & 0xff);
    const u16 = (v) => out.push((v >>> 8) & 0xff, v & 0xff);
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

  let ws = null, sessionId = null, frames = 0, frameTimes = [], blockSent = {}, startFrameId = null;
  const canvas = $("canvas"), ctx = canvas.getContext("2d");
  const setStatus = (s) => { $("status").textContent = s; };
  const running = (on) => { $("start").disabled = on; $("stop").disabled = !on; $("apply").disabled = !on; };
  $("blend").oninput = () => { $("blendValue").textContent = $("blend").value; };
  $("tau").oninput = () => { $("tauValue").textContent = $("tau").value; };
  $("tau").onchange = () => { if (ws && ws.readyState === 1) ws.send(msg({ tau: Number($("tau").value) })); };
  $("strength").oninput = () => { $("strengthValue").textContent = $("strength").value; };

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
        sent += 1; $("framesSent").textContent = sent; document.body.dataset.webcamFramesSent = sent;
      }), "image/jpeg", 0.85);
    }, FRAME_MS);
  }
  function closeCamera() {
    clearInterval(capture); capture = null;
    if (stream) stream.getTracks().forEach((t) => t.stop());
    stream = null; camera.srcObject = null;
  }

  // Start frame (Krea's start_frame): the chosen image is uploaded (POST /upload_start_frame) when Start is
  // pressed; its id goes in the start parameters, and the video (and every reset) starts from the image
  const withToken = (url) =>
    (token ? url + (url.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(token) : url);
  async function uploadStartFrame() {
    const file = $("startFrame").files[0];
    if (!file) return null;
    const form = new FormData();
    form.append("file", file, file.name);
    const r = await fetch(withToken("/upload_start_frame"), { method: "POST", body: form });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body.error || "HTTP " + r.status);
    return body.id;
  }

  function draw(blob) {
    createImageBitmap(blob).then((img) => {
      if (canvas.width !== img.width) { canvas.width = img.width; canvas.height = img.height; }
      ctx.drawImage(img, 0, 0);
      frames += 1; $("frames").textContent = frames; document.body.dataset.framesDrawn = frames;
      const now = performance.now(); frameTimes.push(now);
      while (frameTimes.length && now - frameTimes[0] > 2000) frameTimes.shift();
      $("fps").textContent = (frameTimes.length / 2).toFixed(1);
    });
  }

  function onText(data) {
    const m = JSON.parse(data);
    if (m.status === "ready") {
      setStatus("ready");
      const start = { prompt: $("prompt").value, seed: Number($("seed").value), num_blocks: Number($("numBlocks").value),
                      tau: Number($("tau").value), request_id: "page" };
      if (stream) { start.webcam_mode = true; start.strength = Number($("strength").value); }
      if (startFrameId) start.start_frame = startFrameId;
      ws.send(msg(start));
    } else if (m.status === "queued") setStatus("queued, position " + m.position);
    else if (m.status === "params" || m.status === "running") {
      if (m.status === "params") {
        setStatus((m.state === "queued" ? "queued" : "generating") + " (seed " + m.seed + ")");
        document.body.dataset.strength = m.options.strength;
        const sf = m.start_frame ? m.start_frame.width + "x" + m.start_frame.height : "";
        $("startFrameInfo").textContent = sf ? "from a " + sf + " start frame" : "";
        document.body.dataset.startFrame = sf;
      }
      else setStatus("generating");
      if (m.status === "running" || m.state === "running") startCapture();
    }
    else if (m.status === "stats") {
      const line = document.createElement("div");
      line.className = m.decision; line.dataset.decision = m.decision;
      line.textContent = "block " + m.block + ": " + m.decision + " score " +
        (m.score === null ? "-" : m.score.toFixed(3)) + " (" + m.producer + ")";
      if (m.prompt_index !== undefined) {  // a live session's block: the prompt it was made under, blend weight
        line.dataset.promptIndex = m.prompt_index; line.dataset.blendWeight = m.blend_weight;
        line.textContent += " prompt " + m.prompt_index + (m.blend_weight < 1 ? " (blend " + m.blend_weight.toFixed(2) + ")" : "");
      }
      $("blocks").appendChild(line);
      $("latency").textContent = (m.latency_s * 1000).toFixed(0);
      $("acceptance").textContent = m.acceptance === null ? "-" : m.acceptance.toFixed(2);
    } else if (m.status === "ack") {
      setStatus("update " + m.field + " takes effect at block " + m.block);
      document.body.dataset.lastAck = m.field + ":" + m.block;
    }
    else if (m.status === "error") { setStatus("error: " + m.error); document.body.dataset.lastError = m.error; }
    else if (m.status === "completed") {
      setStatus("completed"); $("download").disabled = false; running(false); closeCamera();
    }
  }

  $("start").onclick = async () => {
    sessionId = "page-" + Math.random().toString(36).slice(2, 12);
    if (ws) { const old = ws; ws = null; old.close(); }  // a finished session's socket (the server keeps it open)
    frames = 0; sent = 0; $("blocks").textContent = ""; $("download").disabled = true;
    $("startFrameInfo").textContent = ""; delete document.body.dataset.startFrame;
    $("start").disabled = true;  // until the socket is open (the upload and the camera come first)
    const failed = (what, err) => {
      setStatus(what + ": " + err.message); document.body.dataset.lastError = what + ": " + err.message;
      $("start").disabled = false;
    };
    try { startFrameId = await uploadStartFrame(); } catch (err) { failed("start frame", err); return; }
    if ($("webcam").checked) {
      try { await openCamera(); } catch (err) { failed("camera", err); return; }
    }
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const sock = ws = new WebSocket(scheme + location.host + withToken("/session/" + sessionId + "?sdvg=1"));
    sock.binaryType = "blob";
    // an earlier session's socket, closed or closing, no longer speaks for the page
    sock.onmessage = (e) => {
      if (sock !== ws) return;
      if (typeof e.data === "string") onText(e.data); else draw(e.data);
    };
    sock.onclose = () => {
      if (sock !== ws) return;
      running(false); closeCamera();
      if ($("status").textContent !== "completed") setStatus("disconnected");
    };
    running(true);
  };
  $("stop").onclick = () => { if (ws) ws.close(); };
  $("apply").onclick = () => {
    if (ws && ws.readyState === 1) ws.send(msg({ prompt: $("prompt").value, interp_steps: Number($("blend").value) }));
  };
  $("download").onclick = () => { location.href = withToken("/download_video/" + sessionId); };
})();
