"""The MP4 of each session's current run, written block by block by sdvg's incremental writer
(`sdvg.io.video_writer`): a file named by the session id under the server's folder, finished when
the run ends (completed, reset, disconnect or shutdown); the newest `keep` finished files are kept
for GET /download_video/{id}."""
from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from sdvg.io.video_writer import IncrementalMP4Writer


class VideoStore:
    def __init__(self, folder: Path, fps: float, keep: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fps, self.keep = fps, keep
        self._finished: OrderedDict[str, Path] = OrderedDict()
        self._writing: set[str] = set()
        self._lock = threading.Lock()

    def path(self, session_id: str) -> Path:
        return self.folder / f"{session_id}.mp4"  # the id matched security.SESSION_ID

    def writer(self, session_id: str) -> IncrementalMP4Writer:
        with self._lock:
            self._finished.pop(session_id, None)
            self._writing.add(session_id)
        return IncrementalMP4Writer(self.path(session_id), fps=self.fps, crf=18)

    def finish(self, session_id: str, writer: IncrementalMP4Writer) -> None:
        try:
            writer.close()
        finally:
            with self._lock:
                self._writing.discard(session_id)
                if self.path(session_id).is_file():
                    self._finished[session_id] = self.path(session_id)
                    self._finished.move_to_end(session_id)
                old = []
                while len(self._finished) > self.keep:
                    old.append(self._finished.popitem(last=False)[1])
            for p in old:
                p.unlink(missing_ok=True)

    def state(self, session_id: str) -> tuple[str, Path | None]:
        """'writing', 'finished' (with the file) or 'none'."""
        with self._lock:
            if session_id in self._writing:
                return "writing", None
            if session_id in self._finished:
                return "finished", self._finished[session_id]
        return "none", None
