"""Krea Realtime Video's clients against sdvg serve, as they are used: the step counts and sizes Krea's page
sends, its uploads, webcam frames, queueing, late updates and downloads (docs/server.md). The client here is
written from reading Krea's `templates/release_demo.html` and `test_client.py` (krea-ai/realtime-video at
acf4b7b): the same message names, field types and order."""
from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

pytest.importorskip("fastapi")
msgpack = pytest.importorskip("msgpack")
websockets = pytest.importorskip("websockets")

from serve_harness import decode_jpeg, run_session, running_server, upload  # noqa: E402

from sdvg.serve.protocol import ProtocolError, parse_params  # noqa: E402


def page_parameters(prompt: str, width: int = 832, height: int = 480, num_blocks: int = 9, steps: int = 5,
                    video: str | None = None, start_frame: str | None = None, strength: float = 0.8,
                    webcam_fps: int | None = None, seed: int | None = None) -> dict:
    """What Krea's page sends first (`sendParams`): its fields in its order, numbers as its msgpack encoder writes
    them (`Number(...)` of the inputs: the shift slider's "5.0" is 5). Webcam mode (`webcam_fps` given) adds
    webcam_mode, webcam_fps, strength; otherwise an uploaded video adds input_video and strength, an uploaded start
    frame start_frame (each the upload reply's `path`); a typed seed comes last."""
    out = {"prompt": prompt, "width": width, "height": height, "num_blocks": num_blocks,
           "num_denoising_steps": steps, "timestep_shift": 5}
    if webcam_fps is not None:
        out.update(webcam_mode=True, webcam_fps=webcam_fps, strength=strength)
    else:
        if video is not None:
            out.update(input_video=video, strength=strength)
        if start_frame is not None:
            out["start_frame"] = start_frame
    if seed is not None:
        out["seed"] = seed
    return out


@pytest.fixture(scope="module")
def engine(tiny_pipe):
    from sdvg.serve.engine import Engine

    return Engine(tiny_pipe, max_steps=8, max_pixels=832 * 480)


def spec_of(engine, data):
    return engine.spec(parse_params(data), 256, lambda _: False)


def test_the_pages_default_steps_and_sizes_are_taken(engine, tiny_pipe):
    spec = spec_of(engine, page_parameters("a lighthouse"))
    assert (spec.width, spec.height, spec.options.target_steps) == (832, 480, 5)
    portrait = spec_of(engine, page_parameters("a lighthouse", width=480, height=832))  # one of Krea's shapes
    assert (portrait.width, portrait.height) == (480, 832)
    assert spec_of(engine, {"prompt": "x"}).options.target_steps is None  # left out: the preset's lists
    assert (spec_of(engine, {"prompt": "x"}).width, spec_of(engine, {"prompt": "x"}).height) == (64, 64)
    view = engine.pipe_at(480, 832)  # another size: the same weights, the size its own
    assert view.components.drafter is tiny_pipe.components.drafter and view.preset.video.width == 832
    assert engine.pipe_at(480, 832) is view and engine.pipe_at(64, 64) is tiny_pipe


@pytest.mark.parametrize("data, field, words", [
    (page_parameters("x", width=840), "width", "multiples of 16 (the VAE's stride times the patch size); send 832"),
    (page_parameters("x", height=40), "height", "send 32"),
    (page_parameters("x", width=1664, height=960), "width", "at most 399360 pixels (--max-pixels)"),
    (page_parameters("x", steps=9), "num_denoising_steps", "1 to 8 steps (--max-steps)"),
    (page_parameters("x", steps=0), "num_denoising_steps", "1 to 8 steps"),
])
def test_steps_and_sizes_past_the_bounds_are_refused_by_name(engine, data, field, words):
    with pytest.raises(ProtocolError) as exc:
        spec_of(engine, data)
    assert exc.value.field == field and words in str(exc.value), str(exc.value)


def test_only_the_eager_backend_makes_other_sizes(tiny_pipe):
    from sdvg.config import ConfigError
    from sdvg.serve.engine import Engine

    class Compiled:  # a pipeline whose stages are built for its preset's size
        preset, default_backend = tiny_pipe.preset, "compile"

        def resized(self, height, width):
            raise AssertionError("never asked")

    with pytest.raises(ProtocolError, match="backend eager makes other sizes"):
        spec_of(Engine(Compiled(), max_pixels=832 * 480), page_parameters("x"))
    tiny_pipe.default_backend = "compile"
    try:
        with pytest.raises(ConfigError) as e:
            tiny_pipe.resized(480, 832)
        assert all(s in str(e.value) for s in ("compile", "eager")), e.value
    finally:
        tiny_pipe.default_backend = "eager"


def test_a_session_at_another_size_and_step_count_is_bitwise_the_pipelines(tiny_pipe, tmp_path):
    want = list(tiny_pipe.resized(64, 96).stream("a red fox", num_blocks=2, seed=4, target_steps=3,
                                                 scheduler="reference"))
    with running_server(tiny_pipe, tmp_path) as (url, _):
        out = asyncio.run(run_session(url, {"prompt": "a red fox", "width": 96, "height": 64, "num_blocks": 2,
                                            "seed": 4, "num_denoising_steps": 3}, fmt="raw", superset=True))
    params = next(t for t in out["texts"] if t.get("status") == "params")
    assert (params["width"], params["height"], params["options"]["target_steps"]) == (96, 64, 3)
    assert np.array_equal(np.stack(out["frames"]), np.concatenate([b.frames.numpy() for b in want]))


def jpeg_roundtrip(frames: np.ndarray) -> np.ndarray:
    from sdvg.serve.encode import jpeg

    return np.stack([decode_jpeg(jpeg(f, 90)) for f in frames])


def write_clip(path, frames: int = 21, seed: int = 3) -> None:
    import imageio_ffmpeg

    writer = imageio_ffmpeg.write_frames(str(path), (80, 48), fps=16, quality=None, output_params=["-crf", "0"],
                                         macro_block_size=1)
    writer.send(None)
    rng = np.random.default_rng(seed)
    for _ in range(frames):
        writer.send(rng.integers(0, 256, size=(48, 80, 3), dtype=np.uint8).tobytes())
    writer.close()


def test_the_pages_uploads_are_sent_back_by_their_path_and_used(tiny_pipe, tmp_path):
    """The page posts the file, keeps `result.path` and sends it as start_frame / input_video: the opaque upload
    id (no server path), which the session then uses (its frames are the pipeline's from that image / clip)."""
    import io

    from PIL import Image

    from sdvg.io.video_input import read_video

    image = np.random.default_rng(4).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    write_clip(tmp_path / "in.mp4", frames=9)  # one block's frames
    with running_server(tiny_pipe, tmp_path / "server") as (url, _):
        status, frame = upload(url, "/upload_start_frame", png.getvalue(), "start.png")
        assert status == 200 and frame["path"].startswith("up_") and "/" not in frame["path"]
        assert frame["filename"] == "start.png"
        status, clip = upload(url, "/upload_video", (tmp_path / "in.mp4").read_bytes(), "in.mp4")
        assert status == 200 and clip["path"].startswith("up_")
        started = asyncio.run(run_session(url, page_parameters("a lighthouse", 64, 64, 1, seed=6,
                                                               start_frame=frame["path"]), session_id="page-sf"))
        driven = asyncio.run(run_session(url, page_parameters("a lighthouse", 64, 64, 9, seed=6, video=clip["path"]),
                                         session_id="page-v2v"))
    want = list(tiny_pipe.stream("a lighthouse", num_blocks=1, seed=6, target_steps=5, start_frame=image,
                                 scheduler="reference"))
    assert started["texts"] == [{"session_id": "page-sf", "status": "completed"}]
    assert np.array_equal(np.stack(started["frames"]), jpeg_roundtrip(want[0].frames.numpy()))
    session = tiny_pipe.session("a lighthouse", num_blocks=1, seed=6, target_steps=5, scheduler="reference",
                                input_video=read_video(tmp_path / "in.mp4", 9, 16), strength=0.8)
    assert driven["texts"] == [{"session_id": "page-v2v", "status": "completed"}]  # 9 blocks asked, the clip has 1
    assert np.array_equal(np.stack(driven["frames"]), jpeg_roundtrip(np.concatenate([b.frames.numpy()
                                                                                      for b in session])))


def test_image_text_is_base64_or_a_data_url_and_bounded():
    import base64

    from sdvg.serve.uploads import UploadError, image_bytes

    data = b"\xff\xd8\xff" + bytes(range(200))
    text = base64.b64encode(data).decode()
    assert image_bytes(data, 1000) == image_bytes(text, 1000) == data
    assert image_bytes("data:image/jpeg;base64," + text, 1000) == data
    for bad, status, words in (("data:image/jpeg," + text, 400, "must be base64"), ("not base64!", 400, "not base64"),
                               (text, 413, "more than 100 bytes"), (data, 413, "at most 100")):
        with pytest.raises(UploadError, match=words) as exc:
            image_bytes(bad, 100 if status == 413 else 1000)
        assert exc.value.status == status


def webcam_frames(count: int, width: int, height: int) -> list[bytes]:
    """JPEG frames as the page's canvas.toBlob makes them (quality 0.9), from moving gradients."""
    import io

    from PIL import Image

    out = []
    y, x = np.mgrid[0:height, 0:width]
    for t in range(count):
        rgb = np.stack([(x * 4 + t * 9) % 256, (y * 4 + t * 5) % 256, ((x + y) * 2) % 256], -1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def test_the_pages_webcam_frames_in_base64_drive_the_session(tiny_pipe, tmp_path):
    """Webcam mode as the page runs it: parameters with webcam_mode, webcam_fps and strength, then each camera frame
    as `{image: <base64 of the JPEG>, timestamp: Date.now(), strength}` (a data URL here and there, which Krea
    decodes too): the session is the pipeline's, fed the same decoded frames."""
    import base64
    import time

    jpegs = webcam_frames(9, 64, 64)  # one block's frames

    async def go(url):
        frames, texts = [], []
        async with websockets.connect(f"ws://{url}/session/page-cam", max_size=2**26) as ws:
            await ws.recv()  # ready
            await ws.send(msgpack.packb(page_parameters("a lighthouse", 64, 64, 1, webcam_fps=30, seed=2)))
            for i, data in enumerate(jpegs):
                text = base64.b64encode(data).decode()
                await ws.send(msgpack.packb({"image": ("data:image/jpeg;base64," + text) if i % 5 == 0 else text,
                                             "timestamp": int(time.time() * 1000), "strength": 0.8}))
            while True:
                m = await asyncio.wait_for(ws.recv(), 240)
                if isinstance(m, bytes):
                    frames.append(decode_jpeg(m))
                    continue
                texts.append(m)
                if '"completed"' in m:
                    return frames, texts

    with running_server(tiny_pipe, tmp_path) as (url, _):
        frames, texts = asyncio.run(go(url))
    assert len(texts) == 1, texts  # completed, nothing else
    session = tiny_pipe.session("a lighthouse", num_blocks=1, seed=2, target_steps=5, scheduler="reference",
                                input_frames=True, strength=0.8)
    session.update(input_frames=np.stack([decode_jpeg(j) for j in jpegs]))
    want = np.concatenate([b.frames.numpy() for b in session])
    assert np.array_equal(np.stack(frames), jpeg_roundtrip(want))


async def plain_run(ws, until_completed: int = 1):
    """Frames and text messages on a plain socket until `until_completed` completed messages came."""
    frames, texts = 0, []
    while sum('"completed"' in t for t in texts) < until_completed:
        m = await asyncio.wait_for(ws.recv(), 240)
        if isinstance(m, bytes):
            frames += 1
        else:
            texts.append(m)
    return frames, [__import__("json").loads(t) for t in texts]


def test_a_plain_client_is_answered_as_krea_answers_and_never_hears_an_sdvg_message(tiny_pipe, tmp_path, caplog):
    """Parameters Krea's pydantic takes (loose types, unknown fields, values sdvg does not honour) start a run; ones it
    refuses, or past the server's bounds, get Krea's `{"error": [...]}` and the socket waits for better ones; every
    update sdvg would refuse (sdvg-only fields and actions, an image on a text session, strength alone, a non-map, a
    text frame, a prompt too late for the run) is dropped without a reply; the operator is told."""
    import json
    import logging

    caplog.set_level(logging.WARNING, logger="sdvg.serve")
    with running_server(tiny_pipe, tmp_path) as (url, app):
        async def go():
            async with websockets.connect(f"ws://{url}/session/plain-1") as ws:
                assert set(json.loads(await ws.recv())) == {"status", "worker"}  # Krea's ready, exactly
                refused = []
                for bad in ({"prompt": 3}, [1, 2], page_parameters("x", 64, 64, steps=9),
                            page_parameters("x", 1664, 960)):
                    await ws.send(msgpack.packb(bad))
                    refused.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
                loose = {"prompt": "a lighthouse", "width": "70", "height": 64.0, "num_blocks": "1", "seed": "6",
                         "num_denoising_steps": 5, "timestep_shift": 6.5, "context_noise": 0.2, "strength": 0.5,
                         "interp_blocks": 3, "bogus": {"x": 1}, "scheduler": "cpp"}
                await ws.send(msgpack.packb(loose))
                for update in ({"tau": 0.5}, {"action": "ping"}, {"action": "pause"}, {"image": b"\xff\xd8\xff"},
                               {"strength": 0.4}, [1, 2, 3], {"interp_steps": 3}, {"unknown": True},
                               {"seed": "not a number"}, {"prompt": "a lighthouse in fog", "interp_steps": "soon"}):
                    await ws.send(msgpack.packb(update))
                await ws.send("a text frame")
                first = await plain_run(ws)
                await ws.send(msgpack.packb({"prompt": "too late for this run"}))  # the run is over
                await ws.send(msgpack.packb({"action": "reset"}))
                second = await plain_run(ws)
                return refused, first, second

        refused, first, second = asyncio.run(go())
        adjusted = {s.labels["reason"]: s.value for m in app.state.metrics.plain_adjusted.collect()
                    for s in m.samples if s.name.endswith("_total")}
    for reply, loc in zip(refused, (["prompt"], [], ["num_denoising_steps"], ["width"])):
        assert set(reply) == {"error"} and isinstance(reply["error"], list), reply  # Krea's shape
        assert reply["error"][0]["loc"] == loc and reply["error"][0]["msg"], reply
    assert "1 to 8 steps" in refused[2]["error"][0]["msg"]
    assert first == (9, [{"session_id": "plain-1", "status": "completed"}])  # 1 block at 64x64, nothing else
    assert second == (9, [{"session_id": "plain-1", "status": "completed"}])
    assert adjusted["ignored_field"] >= 6 and adjusted["floored"] == 1 and adjusted["dropped_update"] >= 6
    assert adjusted["refused_params"] == 4
    said = caplog.text
    assert "session plain-1 (plain client)" in said and "unknown parameter 'bogus' ignored" in said
    assert "width 70 floored to 64" in said


def test_a_queued_plain_client_waits_silently_then_runs(tiny_pipe, tmp_path):
    """Every slot busy: an sdvg client would hear `queued`; a plain one (Krea's page treats any message with a
    session_id as the end) hears nothing until its frames come, then Krea's completed; a gauge counts it."""
    import json
    import time

    with running_server(tiny_pipe, tmp_path, max_sessions=1, max_queue=2) as (url, app):
        gauge = app.state.metrics.plain_queued

        async def go():
            async with websockets.connect(f"ws://{url}/session/holder?sdvg=1") as holder, \
                    websockets.connect(f"ws://{url}/session/plain-q") as plain:
                await holder.recv()
                await holder.send(msgpack.packb({"prompt": "a fox", "num_blocks": 1}))
                await holder.send(msgpack.packb({"action": "pause"}))
                while json.loads(await holder.recv()).get("status") != "ack":
                    pass
                await plain.recv()  # ready
                await plain.send(msgpack.packb(page_parameters("a lighthouse", 64, 64, 1)))
                deadline = time.monotonic() + 30
                while gauge._value.get() != 1:
                    assert time.monotonic() < deadline, "the plain client was never queued"
                    await asyncio.sleep(0.05)
                await holder.send(msgpack.packb({"action": "resume"}))
                return await plain_run(plain)

        frames, texts = asyncio.run(go())
    assert frames == 9 and texts == [{"session_id": "plain-q", "status": "completed"}]
    assert gauge._value.get() == 0


def test_krea_test_client_as_its_users_run_it(tiny_pipe, tmp_path):
    """Krea's test_client.py with its parameters line enabled, as its users run it: /session/test123 (fmt jpeg), a
    prompt, a seed and num_blocks 1000 (capped at the server's --max-blocks, told to the operator), then the same
    image every few seconds (ignored on a text-to-video session, as Krea's server ignores it)."""
    jpeg = webcam_frames(1, 64, 64)[0]

    async def go(url):
        async with websockets.connect(f"ws://{url}/session/test123") as ws:
            await ws.recv()
            await ws.send(msgpack.packb({"prompt": "A cat riding a skateboard", "seed": 5366, "num_blocks": 1000}))
            await ws.send(msgpack.packb({"image": jpeg}))
            return await plain_run(ws)

    with running_server(tiny_pipe, tmp_path, max_blocks=2) as (url, _):
        frames, texts = asyncio.run(go(url))
    assert frames == 9 + 12 and texts == [{"session_id": "test123", "status": "completed"}]


def test_a_run_video_cut_for_a_download_joins_into_the_same_frames(tmp_path):
    """The MP4 of a run in progress: cut between blocks, its segments joined with their streams copied, gives the
    frames written so far; the run's final MP4 joins every segment and starts with those same decoded frames."""
    import torch

    from sdvg.io.video_writer import read_mp4_frames
    from sdvg.serve.videos import VideoStore, join_segments

    store = VideoStore(tmp_path, fps=16, keep=4)
    video = store.writer("run1")
    rng = np.random.default_rng(0)
    blocks = [torch.from_numpy(rng.integers(0, 256, size=(n, 48, 64, 3), dtype=np.uint8)) for n in (9, 12, 12)]
    video.write(blocks[0])
    links = store.snapshot_links(video)  # after block 0
    video.write(blocks[1])
    assert store.state("run1") == ("writing", None)
    join_segments(links, tmp_path / "so-far.mp4")
    again = store.snapshot_links(video)  # after block 1: two segments joined
    join_segments(again, tmp_path / "so-far-2.mp4")
    video.write(blocks[2])
    store.finish("run1", video)
    so_far, so_far_2 = read_mp4_frames(tmp_path / "so-far.mp4"), read_mp4_frames(tmp_path / "so-far-2.mp4")
    state, path = store.state("run1")
    final = read_mp4_frames(path)
    assert state == "finished" and len(so_far) == 9 and len(so_far_2) == 21 and len(final) == 33
    assert np.array_equal(final[:9], so_far) and np.array_equal(final[:21], so_far_2)
    assert not list(tmp_path.glob(".*"))  # no segment, link or partial file left


def test_a_download_while_running_gives_the_frames_so_far(tiny_pipe, tmp_path):
    """Krea's page offers Download from the first frame: a GET while the run is written gives a playable MP4 of the
    blocks made so far (here the session is paused after block 0), whose frames begin the finished video."""
    import json
    import urllib.request

    from sdvg.io.video_writer import read_mp4_frames

    with running_server(tiny_pipe, tmp_path / "server") as (url, _):
        async def go():
            async with websockets.connect(f"ws://{url}/session/dl-1?sdvg=1") as ws:
                await ws.recv()
                await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": 3, "seed": 1}))
                while not (isinstance(m := await asyncio.wait_for(ws.recv(), 240), str)
                           and json.loads(m)["status"] == "stats"):  # block 0 made
                    pass
                await ws.send(msgpack.packb({"action": "pause"}))
                while not (isinstance(m := await asyncio.wait_for(ws.recv(), 240), str)
                           and json.loads(m)["status"] == "ack"):
                    pass
                so_far = await asyncio.to_thread(lambda: urllib.request.urlopen(
                    f"http://{url}/download_video/dl-1", timeout=120).read())
                await ws.send(msgpack.packb({"action": "resume"}))
                while not (isinstance(m := await asyncio.wait_for(ws.recv(), 240), str)
                           and json.loads(m)["status"] == "completed"):
                    pass
                final = await asyncio.to_thread(lambda: urllib.request.urlopen(
                    f"http://{url}/download_video/dl-1", timeout=120).read())
                return so_far, final

        so_far, final = asyncio.run(go())
    (tmp_path / "so-far.mp4").write_bytes(so_far)
    (tmp_path / "final.mp4").write_bytes(final)
    head, whole = read_mp4_frames(tmp_path / "so-far.mp4"), read_mp4_frames(tmp_path / "final.mp4")
    assert len(head) in (9, 21) and len(whole) == 33  # whole blocks: block 0, perhaps block 1 before the pause
    assert np.array_equal(whole[:len(head)], head)


def test_msgpack_frames_carry_krea_s_nil_uuid_without_a_request_id(tiny_pipe, tmp_path):
    with running_server(tiny_pipe, tmp_path) as (url, _):
        out = asyncio.run(run_session(url, page_parameters("a lighthouse", 64, 64, 1), fmt="msgpack",
                                      session_id="nil-id"))
    assert len(out["frames"]) == 9 and set(out["request_ids"]) == {"00000000-0000-0000-0000-000000000000"}


def test_a_second_socket_on_an_id_in_use_gets_its_own_session_and_video(tiny_pipe, tmp_path):
    """Two sockets on one session id (test_client.py's fixed `test123`, run twice at once): both run; the second's
    video is its own (`id.1`, the session_id of its completed, which Krea's page downloads by) and never replaces
    the first's; an sdvg client's completed carries its download_url."""
    import urllib.request

    from sdvg.io.video_writer import read_mp4_frames

    async def both(url):
        socks = []
        for query in ("", "", "?sdvg=1"):  # in this order: each opens while the others hold the id
            socks.append(await websockets.connect(f"ws://{url}/session/dup{query}"))
            await socks[-1].recv()  # ready
        try:
            for ws, blocks in zip(socks, (1, 2, 1)):
                await ws.send(msgpack.packb({"prompt": "a cat riding a skateboard", "num_blocks": blocks,
                                             "seed": blocks}))
            return await asyncio.gather(*(plain_run(ws) for ws in socks))
        finally:
            for ws in socks:
                await ws.close()

    with running_server(tiny_pipe, tmp_path / "server") as (url, _):
        (f1, t1), (f2, t2), (f3, t3) = asyncio.run(both(url))
        videos = {key: urllib.request.urlopen(f"http://{url}/download_video/{key}", timeout=60).read()
                  for key in ("dup", "dup.1", "dup.2")}
    assert t1 == [{"session_id": "dup", "status": "completed"}]
    assert t2 == [{"session_id": "dup.1", "status": "completed"}] and (f1, f2) == (9, 21)
    done = [t for t in t3 if t.get("status") == "completed"]
    assert len(done) == 1 and done[0]["session_id"] == "dup.2" and done[0]["status"] == "completed"
    assert re.fullmatch(r"/download_video/dup\.2~[0-9a-f]{16}", done[0]["download_url"])  # that run's own video
    counts = {}
    for key, data in videos.items():
        (tmp_path / f"{key}.mp4").write_bytes(data)
        counts[key] = len(read_mp4_frames(tmp_path / f"{key}.mp4"))
    assert counts == {"dup": 9, "dup.1": 21, "dup.2": 9}


@pytest.mark.slow
def test_the_pages_defaults_make_an_832x480_video_in_5_steps(tiny_pipe, tmp_path):
    """Krea's page unchanged: 832x480 at 5 steps (one block here: tiny's VAE takes seconds a block at this size)."""
    with running_server(tiny_pipe, tmp_path) as (url, _):
        out = asyncio.run(run_session(url, page_parameters("a lighthouse", num_blocks=1, seed=3), session_id="page-832"))
    want = list(tiny_pipe.resized(480, 832).stream("a lighthouse", num_blocks=1, seed=3, target_steps=5,
                                                    scheduler="reference"))
    assert out["texts"] == [{"session_id": "page-832", "status": "completed"}]
    assert np.array_equal(np.stack(out["frames"]), jpeg_roundtrip(want[0].frames.numpy()))
    assert out["frames"][0].shape == (480, 832, 3)


def test_a_prompt_after_the_run_is_the_next_runs(tiny_pipe, tmp_path):
    """Krea stores a prompt sent when no run is in progress for the next one: sdvg's ack says `next run` and the
    reset's run starts from it; a router update then is refused by name (a plain client hears nothing of either)."""
    import json

    async def go(url):
        async with websockets.connect(f"ws://{url}/session/late?sdvg=1") as ws:
            await ws.recv()
            await ws.send(msgpack.packb({"prompt": "a fox", "num_blocks": 1}))
            while not (isinstance(m := await asyncio.wait_for(ws.recv(), 240), str)
                       and json.loads(m)["status"] == "completed"):
                pass
            await ws.send(msgpack.packb({"prompt": "an owl", "request_id": "p1"}))
            await ws.send(msgpack.packb({"tau": 0.5}))
            replies = [json.loads(await asyncio.wait_for(ws.recv(), 30)) for _ in range(2)]
            await ws.send(msgpack.packb({"action": "reset"}))
            while not (isinstance(m := await asyncio.wait_for(ws.recv(), 240), str)
                       and json.loads(m)["status"] == "params"):
                pass
            return replies, json.loads(m)

    with running_server(tiny_pipe, tmp_path) as (url, _):
        replies, params = asyncio.run(go(url))
    assert replies[0] == {"status": "ack", "field": "prompt", "block": None, "request_id": "p1", "effective": "next run"}
    assert replies[1]["status"] == "error" and replies[1]["field"] == "tau" and "the session is done" in replies[1]["error"]
    assert params["prompt"] == "an owl" and params["state"] == "running"
