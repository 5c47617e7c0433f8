"""The MP4 of each session's run, written block by block by sdvg's incremental writer
(`sdvg.io.video_writer`) under a name the server made, finished when the run ends (completed, reset,
disconnect or shutdown). Frames are never held in memory.

Each run's video is its own file, named by its **run key** `<video key>~<16 hex>` (random: only the client
its `completed` went to knows it), so no later run replaces it, on the same socket (a reset) or on a reused
id. GET /download_video/<run key> answers that video (sdvg clients' `download_url`); GET
/download_video/<video key> answers the latest video of that key (Krea's rule, what its page asks for).
The newest `keep` finished files are kept.

A download while the run is being written gets the frames so far as a playable MP4: the worker cuts the
run's video between two blocks (`RunVideo.cut`: the segment written so far is finished, the next block
starts a new one) and hard-links the finished segments for the download, which joins them off the worker
(`join_segments`, ffmpeg's concat demuxer, streams copied); the run's final MP4 joins its segments the same
way when it ends."""
from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from sdvg.io.video_writer import IncrementalMP4Writer, VideoWriteError


def join_segments(segments: list[Path], out: Path) -> None:
    """`segments` (finished MP4s of one run, in order) as one MP4 at `out`: the streams copied (ffmpeg's concat
    demuxer; every path is one the server made)."""
    import imageio_ffmpeg

    if len(segments) == 1:
        os.replace(segments[0], out)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=out.parent, delete=False) as listing:
        for seg in segments:
            listing.write("file '" + str(seg.resolve()).replace("'", "'\\''") + "'\n")
    try:
        done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "concat", "-safe",
                               "0", "-i", listing.name, "-c", "copy", "-movflags", "+faststart", "-f", "mp4",
                               str(out)], capture_output=True, timeout=600)
    finally:
        os.unlink(listing.name)
    if done.returncode != 0:
        raise VideoWriteError(f"joining {len(segments)} segments into {out.name} failed: "
                              + done.stderr.decode("utf-8", "replace").strip()[-300:])
    for seg in segments:
        seg.unlink(missing_ok=True)


class RunVideo:
    """One run's MP4 as it is written: the current segment's writer and the finished segments (worker only)."""

    def __init__(self, folder: Path, key: str, fps: float):
        self.folder, self.key, self.fps = folder, key, fps
        self.run_key = f"{key}~{secrets.token_hex(8)}"  # this run's own file (security.VIDEO_KEY)
        self.segments: list[Path] = []
        self.current: IncrementalMP4Writer | None = None
        self.frames = 0  # written in all
        self._count = 0

    def write(self, frames) -> None:
        if self.current is None:
            self._count += 1
            self.current = IncrementalMP4Writer(self.folder / f".{self.key}.part{self._count}.mp4", fps=self.fps,
                                                crf=18)
        self.current.write(frames)
        self.frames += frames.shape[0]

    def cut(self) -> list[Path]:
        """Finish the segment being written; the finished segments (every frame written so far)."""
        if self.current is not None:
            writer, self.current = self.current, None
            writer.close()
            if writer.path.is_file():
                self.segments.append(writer.path)
        return list(self.segments)

    def close(self, out: Path) -> None:
        """The run's MP4 at `out` (nothing when no frame was written)."""
        segments = self.cut()
        self.segments = []
        if segments:
            join_segments(segments, out)


class VideoStore:
    def __init__(self, folder: Path, fps: float, keep: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fps, self.keep = fps, keep
        self._finished: OrderedDict[str, Path] = OrderedDict()  # run key -> its MP4, oldest first
        self._latest: dict[str, str] = {}  # video key -> the run key of its latest finished video
        self._writing: dict[str, str] = {}  # video key -> the run key being written
        self._lock = threading.Lock()

    def path(self, run_key: str) -> Path:
        return self.folder / f"{run_key}.mp4"  # a key the server made from a validated id (security.VIDEO_KEY)

    def writer(self, key: str) -> RunVideo:
        """A new run's video for the socket whose video key is `key` (its own file: nothing finished is touched)."""
        video = RunVideo(self.folder, key, self.fps)
        with self._lock:
            self._writing[key] = video.run_key
        return video

    def finish(self, key: str, video: RunVideo) -> None:
        path = self.path(video.run_key)
        try:
            video.close(path)
        finally:
            with self._lock:
                if self._writing.get(key) == video.run_key:
                    del self._writing[key]
                if path.is_file():
                    self._finished[video.run_key] = path
                    self._latest[key] = video.run_key
                old = []
                while len(self._finished) > self.keep:
                    run_key, p = self._finished.popitem(last=False)
                    old.append(p)
                    owner = run_key.split("~", 1)[0]
                    if self._latest.get(owner) == run_key:
                        del self._latest[owner]
            for p in old:
                p.unlink(missing_ok=True)

    def snapshot_links(self, video: RunVideo) -> list[Path]:
        """(worker) The frames so far of a run being written: its video cut, each finished segment hard-linked
        under a new name for the download to join (the links outlive the run's own segments)."""
        links = []
        for seg in video.cut():
            link = self.folder / f".snapshot-{secrets.token_hex(8)}.mp4"
            os.link(seg, link)
            links.append(link)
        return links

    def writing(self, key: str) -> str | None:
        """The run key being written for video key `key`, if any."""
        with self._lock:
            return self._writing.get(key)

    def state(self, key: str) -> tuple[str, Path | None]:
        """For a run key: 'finished' (with the file), 'writing' or 'none'; for a video key (Krea's download): its run
        being written ('writing'), else its latest finished video, else 'none'."""
        with self._lock:
            if "~" in key:
                if key in self._finished:
                    return "finished", self._finished[key]
                return ("writing", None) if key in self._writing.values() else ("none", None)
            if key in self._writing:
                return "writing", None
            if key in self._latest:
                return "finished", self._finished[self._latest[key]]
        return "none", None
