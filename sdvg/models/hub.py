"""Where a component's weights come from: a local path, or a Hugging Face Hub repo resolved through
`huggingface_hub` (its cache, `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `refs/<revision>`).

A component is given as
- a local file or folder (a checkpoint, a diffusers folder, an HF-cache snapshot folder), or
- `org/name[@revision][/path/in/repo]`: a hub repo, optionally at a revision (branch, tag or commit)
  and a file inside it; `org/name` alone takes the file (or folder patterns) the preset names for
  that component when the repo is the preset's, and the whole repo otherwise.

Nothing is fetched when `HF_HUB_OFFLINE=1`: what is not cached is reported, every missing file at
once, with the command that fetches it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from sdvg.config import HubSource

_REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+?)(?:@(?P<rev>[\w.\-/]+?))?(?:/(?P<path>.+))?$")


class MissingWeightsError(FileNotFoundError):
    """Weights named by a hub repo are not in the local cache (offline) or not on the hub."""


@dataclass(frozen=True)
class Missing:
    role: str
    source: HubSource
    reason: str

    def fetch_command(self) -> str:
        rev = "" if self.source.revision == "main" else f" --revision {self.source.revision}"
        what = self.source.filename or " ".join(f"--include '{p}'" for p in self.source.patterns)
        return f"{hub_cli()} download {self.source.repo_id} {what}{rev}".rstrip()


def hub_cli() -> str:
    """The hub's command-line tool: `hf` (huggingface_hub >= 1) or `huggingface-cli` (older)."""
    import huggingface_hub

    return "hf" if int(huggingface_hub.__version__.split(".")[0]) >= 1 else "huggingface-cli"


def parse_source(spec: str, default: HubSource | None) -> HubSource | None:
    """A hub source from `org/name[@revision][/path]`, or None when `spec` does not look like one."""
    m = _REPO.match(spec)
    if m is None or spec.startswith((".", "/", "~")):
        return None
    repo, rev, path = m.group("repo"), m.group("rev"), m.group("path")
    if path:
        base = HubSource(repo, path)
    elif default is not None and default.repo_id == repo:
        base = default
    else:
        base = HubSource(repo)  # the whole repo (a folder)
    return replace(base, revision=rev) if rev else base


def resolve_source(source: HubSource) -> Path:
    """The local path of a hub file or folder (fetched unless offline); raises what huggingface_hub raises."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub import constants

    offline = bool(constants.HF_HUB_OFFLINE)
    if source.filename is not None:
        return Path(hf_hub_download(source.repo_id, source.filename, revision=source.revision,
                                    local_files_only=offline))
    folder = Path(snapshot_download(source.repo_id, revision=source.revision,
                                    allow_patterns=list(source.patterns) or None, local_files_only=offline))
    if source.patterns and not any(any(folder.glob(p)) for p in source.patterns):
        raise FileNotFoundError(f"no file of {source.repo_id} matches {list(source.patterns)} in {folder}")
    return folder


def resolve_components(specs: dict[str, str | Path | None], defaults: dict[str, HubSource | None]) -> dict:
    """{role: local path or None} for every role of `specs`: a local path is kept, a hub spec (or None
    with a preset default) is resolved. Every missing file is collected and reported together."""
    out: dict[str, Path | None] = {}
    missing: list[Missing] = []
    for role, spec in specs.items():
        default = defaults.get(role)
        if spec is not None and Path(spec).expanduser().exists():
            out[role] = Path(spec).expanduser()
            continue
        if spec is None:
            if default is None:
                out[role] = None
                continue
            source = default
        else:
            source = parse_source(str(spec), default)
            if source is None:
                raise FileNotFoundError(f"{role}: {spec} is neither a local file or folder nor a hub repo id "
                                        "(org/name[@revision][/path/in/repo])")
        try:
            out[role] = resolve_source(source)
        except Exception as exc:  # huggingface_hub's not-cached / not-found / offline errors
            if not _is_missing(exc):
                raise
            missing.append(Missing(role, source, type(exc).__name__))
    if missing:
        lines = [f"  {m.role}: {m.source.repo_id} {m.source.filename or list(m.source.patterns)} "
                 f"(revision {m.source.revision}; {m.reason})" for m in missing]
        fetch = [f"  {m.fetch_command()}" for m in missing]
        raise MissingWeightsError("weights not found in the Hugging Face cache:\n" + "\n".join(lines)
                                  + "\nfetch them (online) with:\n" + "\n".join(fetch)
                                  + "\nor pass local paths for these components")
    return out


def _is_missing(exc: Exception) -> bool:
    from huggingface_hub import errors

    kinds = tuple(getattr(errors, n) for n in ("LocalEntryNotFoundError", "EntryNotFoundError",
                                                "RepositoryNotFoundError", "RevisionNotFoundError",
                                                "OfflineModeIsEnabled") if hasattr(errors, n))
    return isinstance(exc, kinds) or isinstance(exc, FileNotFoundError)
