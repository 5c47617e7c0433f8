"""A Hugging Face Hub on 127.0.0.1 for the download tests: the few routes huggingface_hub's downloads use
(a repo's metadata at a revision with file sizes; a file's HEAD and GET, with Range for resumes), the
hub's error headers (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), transfers that break
part-way, and a log of every request. Point huggingface_hub at it with HF_ENDPOINT (a subprocess) or `constants.ENDPOINT`."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    revisions: tuple[str, ...] = ("main",)
    token: str | None = None  # a gated repo: only this bearer token reaches it
    declared: dict[str, int] = field(default_factory=dict)  # sizes the metadata claims instead of the real ones
    drop_after: dict[str, int] = field(default_factory=dict)  # a file's first GET breaks after this many bytes


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)

    def add(self, repo_id: str, files: dict[str, bytes], commit: str = "c0ffee" * 6 + "abcd", **kw) -> None:
        self.repos[repo_id] = Repo(files, commit, **kw)

    def gets(self, suffix: str) -> list[str | None]:
        """The Range header of every GET of a file whose URL path ends with `suffix`."""
        return [rng for method, path, rng in self.log if method == "GET" and path.endswith(suffix)]

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def _error(self, status: int, code: str | None) -> None:
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.log.append((self.command, path, self.headers.get("Range")))
                if path.startswith("/api/models/"):
                    repo_id, _, revision = path[len("/api/models/"):].partition("/revision/")
                    repo = self._repo(repo_id, revision)
                    if repo is None:
                        return
                    data = json.dumps({"id": repo_id, "sha": repo.commit, "siblings": [
                        {"rfilename": p, "size": repo.declared.get(p, len(b))} for p, b in sorted(repo.files.items())]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if body:
                        self.wfile.write(data)
                    return
                head, sep, rest = path.lstrip("/").partition("/resolve/")
                revision, _, filename = rest.partition("/")
                repo = self._repo(head, revision) if sep else None
                if repo is None:
                    if not sep:
                        self._error(404, None)
                    return
                if filename not in repo.files:
                    return self._error(404, "EntryNotFound")
                data = repo.files[filename]
                start = 0
                rng = self.headers.get("Range")
                if rng and body:
                    start = int(rng.split("=")[1].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", repo.commit)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if body and filename in repo.drop_after:  # a transfer that breaks: the connection closes early
                    self.wfile.write(data[start:start + repo.drop_after.pop(filename)])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if body:
                    self.wfile.write(data[start:])

            def _repo(self, repo_id: str, revision: str) -> Repo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound")
                    return None
                if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._error(403, "GatedRepo")
                    return None
                if revision not in repo.revisions and revision != repo.commit:
                    self._error(404, "RevisionNotFound")
                    return None
                return repo

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
