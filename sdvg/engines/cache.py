"""The engine cache: one directory per built engine, named by the digest of everything the engine
depends on, with a manifest that is checked before an engine is ever used.

The key holds the engine's config hash and weights fingerprint, its input shapes and dtypes, the
precision, the GPU name and compute capability, the TensorRT version and the artifact kind; a
torch-tensorrt program also the torch and torch-tensorrt versions it was built with (it runs
inside that torch only). A stale or foreign engine
is refused with the fields that differ and the command that rebuilds it; a truncated or altered
file is refused.

A file's SHA-256 is computed once, when it is stored (a 14B plan is 27 GiB: hashing it on every
load would read it twice). Each load makes the cheap check: the size, the modification time and
the SHA-256 of its first and last MiB (`ends_sha256`) as stored. A file whose modification time
differs (a copied folder, or a rewritten file) gets the full SHA-256 check, once per load; an
entry written before these fields existed too.

What is on disk keeps its names: the key's `stage` field (the engine's name, e.g. `target_dit_3f_cached`)
is a manifest field and part of the digest, and an entry's folder is `<stage>-<digest>`; renaming either
would orphan every built folder.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_FIELDS: tuple[str, ...] = ("key", "file", "size", "sha256")  # what `load` reads of every manifest
MANIFEST_VERSION = 1
DATA_FILE = "model.onnx.data"  # the external weights of an ONNX file past 2 GB
ARTIFACT_FILES = {"tensorrt": "engine.plan", "onnx": "model.onnx", "torch-tensorrt": "program.ep"}  # kind -> file
_LATER_FIELDS = ("torch_version", "torch_trt_version")  # written only when set: older keys keep their digests


log = logging.getLogger(__name__)


class EngineCacheError(RuntimeError):
    """Base class: an engine cannot be used."""


class StaleEngineError(EngineCacheError):
    """An engine of that name exists but was built for something else."""


class CorruptEngineError(EngineCacheError):
    """An engine file or its manifest is damaged."""


class MissingEngineError(EngineCacheError):
    """No engine of that name was built."""


@dataclass(frozen=True)
class EngineKey:
    # the engine's name (e.g. "target_dit_3f_cached", "vae_decode", "reward_12f"); on-disk name, kept: the field
    # name is in every manifest and in the digest, and the value names the entry's folder
    stage: str
    config_hash: str
    weights_hash: str
    shapes: tuple  # ((input name, (dims...), dtype), ...)
    precision: str
    gpu_name: str
    compute_capability: str
    trt_version: str
    artifact: str = "tensorrt"  # a key of ARTIFACT_FILES
    torch_version: str = "none"  # torch-tensorrt programs only
    torch_trt_version: str = "none"

    def __post_init__(self):
        if self.artifact not in ARTIFACT_FILES:
            raise ValueError(f"unknown engine artifact {self.artifact!r}; the artifacts are "
                             f"{', '.join(ARTIFACT_FILES)}")

    def digest(self) -> str:
        blob = json.dumps(self.as_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shapes"] = [[n, list(s), t] for n, s, t in self.shapes]
        for f in _LATER_FIELDS:
            if d[f] == "none":
                del d[f]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "EngineKey":
        d = dict(d)
        d["shapes"] = tuple((n, tuple(s), t) for n, s, t in d["shapes"])
        return cls(**d)

    def differences(self, other: "EngineKey") -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: built for {b!r}, needed {a!r}")
        return out


def weights_fingerprint(module) -> str:
    """Names, shapes, dtypes and the first and last 1024 values of every tensor of a state dict: changes
    with any checkpoint in practice, without reading all of a 14B model."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            ends = flat[:1024], flat[-1024:]
            for part in ends:
                part = part.float() if part.is_floating_point() else part.long()
                h.update(part.cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


ENDS_BYTES = 1 << 20  # the cheap check hashes this much of a file's start and of its end


def _ends_sha256(path: Path) -> str:
    """SHA-256 of a file's first and last ENDS_BYTES (the whole file when it is smaller than twice that)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        h.update(f.read(ENDS_BYTES))
        if size > ENDS_BYTES:
            f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
            h.update(f.read(ENDS_BYTES))
    return h.hexdigest()


def _file_record(path: Path, name: str) -> dict:
    """What a manifest records of a stored file: the full SHA-256 (computed here, once) and the cheap check."""
    st = path.stat()
    return {"file": name, "size": st.st_size, "sha256": _sha256(path), "mtime_ns": st.st_mtime_ns,
            "ends_sha256": _ends_sha256(path)}


class EngineCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def entry_dir(self, key: EngineKey) -> Path:
        return self.root / f"{key.stage}-{key.digest()[:16]}"  # on-disk folder name, kept

    def store(self, key: EngineKey, artifact: Path, rebuild_command: str) -> Path:
        """Move a built artifact into the cache and write its manifest (atomically). An ONNX file's
        external weights (`<artifact>.data`, written for models past 2 GB) move with it."""
        d = self.entry_dir(key)
        d.mkdir(parents=True, exist_ok=True)
        name = ARTIFACT_FILES[key.artifact]
        dest = d / name
        data = Path(str(artifact) + ".data")
        if Path(artifact).resolve() != dest.resolve():
            os.replace(artifact, dest)
        manifest = {"manifest_version": MANIFEST_VERSION, "key": key.as_json(), "digest": key.digest(),
                    **_file_record(dest, name),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "rebuild_command": rebuild_command}
        if key.artifact == "onnx" and data.is_file():
            data_dest = d / DATA_FILE
            if data.resolve() != data_dest.resolve():
                os.replace(data, data_dest)
            manifest["data_file"] = _file_record(data_dest, DATA_FILE)
        tmp = d / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp, d / MANIFEST)
        log.info("stored the %s engine %r in %s", key.artifact, key.stage, d)
        return dest

    def _read_manifest(self, d: Path) -> dict:
        """The entry's manifest, refused (CorruptEngineError) when unreadable or when a field the load checks
        is missing."""
        try:
            m = json.loads((d / MANIFEST).read_text())
            EngineKey.from_json(m["key"])
        except Exception as exc:
            raise CorruptEngineError(f"engine manifest {d / MANIFEST} is unreadable ({exc}); delete {d} and "
                                     "rebuild") from exc
        missing = [k for k in MANIFEST_FIELDS if k not in m]
        if missing:  # e.g. written by hand or by another tool: never a KeyError later
            raise CorruptEngineError(f"engine manifest {d / MANIFEST} lacks {', '.join(missing)}; delete {d} and "
                                     "rebuild")
        return m

    def check_trt_version(self, version: str, rebuild_command: str) -> None:
        """Refuse a folder holding TensorRT plans (or torch-tensorrt programs) built with another
        TensorRT than `version`, from the manifests alone: before any work, not at the first engine."""
        other = {}
        for m in sorted(self.root.glob(f"*/{MANIFEST}")):
            try:
                key = json.loads(m.read_text())["key"]
            except Exception:
                continue  # a damaged manifest is refused when its engine loads
            if key.get("artifact") in ("tensorrt", "torch-tensorrt") and key.get("trt_version") != version:
                other.setdefault(key.get("trt_version"), []).append(key.get("stage"))  # the manifest's field (kept)
        if other:
            built = "; ".join(f"TensorRT {v}: {', '.join(names)}" for v, names in other.items())
            raise StaleEngineError(f"engine folder {self.root} holds plans built with another TensorRT ({built}); this "
                                   f"is TensorRT {version} and a plan runs only with the TensorRT that built it; "
                                   f"rebuild with: {rebuild_command}")

    def load(self, key: EngineKey, rebuild_command: str) -> Path:
        """The validated artifact for `key`, or an error naming what is wrong and how to rebuild."""
        d = self.entry_dir(key)
        if not (d / MANIFEST).is_file():
            others = sorted(p for p in self.root.glob(f"{key.stage}-*") if (p / MANIFEST).is_file())
            if not others:
                raise MissingEngineError(f"no engine {key.stage!r} in {self.root}; build it with: "
                                         f"{rebuild_command}")
            built = EngineKey.from_json(self._read_manifest(others[-1])["key"])
            diffs = key.differences(built)
            raise StaleEngineError(f"the engine {key.stage!r} in {others[-1]} does not match this "
                                   f"setup ({'; '.join(diffs)}); rebuild with: {rebuild_command}")
        m = self._read_manifest(d)
        built = EngineKey.from_json(m["key"])
        if built != key:  # a digest collision or an edited manifest
            raise StaleEngineError(f"engine {d} does not match ({'; '.join(key.differences(built))}); rebuild "
                                   f"with: {rebuild_command}")
        name = m.get("file")
        want = ARTIFACT_FILES[key.artifact]
        if name != want:
            raise CorruptEngineError(f"engine manifest {d / MANIFEST} names the file {name!r}; an entry of kind "
                                     f"{key.artifact} may only name {want} inside itself; delete {d} and rebuild "
                                     f"with: {rebuild_command}")
        path = d / name
        self._check_file(d, path, m, rebuild_command)
        data = m.get("data_file")
        if data is not None:
            if not isinstance(data, dict) or data.get("file") != DATA_FILE:
                raise CorruptEngineError(f"engine manifest {d / MANIFEST} names the data file {data!r}; it may only "
                                         f"be {DATA_FILE} inside its own entry; delete {d} and rebuild with: "
                                         f"{rebuild_command}")
            self._check_file(d, d / DATA_FILE, data, rebuild_command)
        log.info("using the %s engine %r from %s (built %s)", key.artifact, key.stage, d, m.get("created"))
        return path

    full_checks = 0  # files hashed in full by `load` (the cheap check did not suffice): for tests

    def _check_file(self, d: Path, path: Path, record: dict, rebuild_command: str) -> None:
        """The cheap check (size, modification time, SHA-256 of the ends), or the full SHA-256 when the
        modification time differs or the manifest predates the cheap check."""
        size_want, sha_want = record.get("size"), record.get("sha256")
        if path.is_symlink() or path.resolve().parent != d.resolve():
            raise CorruptEngineError(f"engine file {path} leads outside its entry {d}; delete {d} and rebuild with: "
                                     f"{rebuild_command}")
        if not path.is_file():
            raise CorruptEngineError(f"engine file {path} is missing; rebuild with: {rebuild_command}")
        size = path.stat().st_size
        if size != size_want:
            raise CorruptEngineError(f"engine file {path} is {size} bytes, the manifest says {size_want} (truncated "
                                     f"or overwritten); rebuild with: {rebuild_command}")
        ends = record.get("ends_sha256")
        if ends is not None and _ends_sha256(path) != ends:
            raise CorruptEngineError(f"engine file {path} does not match its SHA-256 (its first or last MiB "
                                     f"changed); rebuild with: {rebuild_command}")
        if ends is not None and record.get("mtime_ns") == path.stat().st_mtime_ns:
            return
        self.full_checks += 1
        if _sha256(path) != sha_want:
            raise CorruptEngineError(f"engine file {path} does not match its SHA-256; rebuild with: "
                                     f"{rebuild_command}")
