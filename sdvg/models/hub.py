"""Where a component's weights come from: a local path, or a Hugging Face Hub repo resolved through
`huggingface_hub` (its cache, `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `refs/<revision>`).

A component is given as
- a local file or folder (a checkpoint, a diffusers folder, an HF-cache snapshot folder), or
- `org/name[@revision][/path/in/repo]`: a hub repo, optionally at a revision (branch, tag or commit)
  and a file inside it; `org/name` alone takes the file (or folder patterns) the preset names for
  that component when the repo is the preset's, and the whole repo otherwise.

Nothing is fetched when `HF_HUB_OFFLINE=1` (or `local_files_only=True`): what is not cached is reported,
every missing file at once, with the command that fetches it (`sdvg download PRESET` for a preset's own
files). `HubAccess` carries the cache folder, token and offline choice of one load or download.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from sdvg.config import PRESETS, ConfigError, HubSource

_REPO = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+?)(?:@(?P<rev>[\w.\-/]+?))?(?:/(?P<path>.+))?$")


# Published repos that hold a preset's components in another layout than the preset's own source: the
# diffusers conversion of the Wan2.1 release (its text_encoder/ + tokenizer/ and vae/ folders).
PUBLISHED: dict[str, tuple[str, dict[str, HubSource]]] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("wan2.1", {
        "text_encoder": HubSource("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", patterns=("text_encoder/*", "tokenizer/*")),
        "vae": HubSource("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", patterns=("vae/*",)),
    }),
}


def repo_roles(repo: str) -> dict[str, dict[str, HubSource]]:
    """{preset name: {role: source}} of every preset that loads a component from hub repo `repo`."""
    out: dict[str, dict[str, HubSource]] = {}
    for preset in PRESETS.values():
        if preset.sources is not None:
            for role in ("drafter", "target", "vae", "text_encoder", "reward", "reward_tokenizer"):
                source = getattr(preset.sources, role)
                if source.repo_id == repo:
                    out.setdefault(preset.name, {})[role] = source
    if repo in PUBLISHED:
        name, roles = PUBLISHED[repo]
        out.setdefault(name, {}).update(roles)
    return out


def preset_for(name: str) -> tuple[str, dict[str, str]]:
    """(preset name, {role: hub spec}) for a preset name, or for the hub repo of a published model
    (`org/name[@revision]`): the preset that loads it, with that repo as the spec of the components it
    holds. Anything else: a ConfigError that lists the presets and the repos they load."""
    if name in PRESETS:
        return name, {}
    m = _REPO.match(name)
    users = repo_roles(m.group("repo")) if m is not None and not name.startswith((".", "/", "~")) else {}
    if len(users) == 1:
        (preset, roles), = users.items()
        return preset, {role: name for role in roles}
    known = "; ".join(f"{repo} ({preset}: {', '.join(roles)})" for repo, preset, roles in published_repos())
    if len(users) > 1:
        raise ConfigError(f"hub repo {name!r} is loaded by presets {sorted(users)}; name the preset: "
                          f"from_pretrained('{sorted(users)[0]}')")
    raise ConfigError(f"{name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a hub repo that a preset "
                      f"loads ({known}); give a preset and this repo as one component, e.g. "
                      f"from_pretrained('wan2.1', target='{name}')")


def published_repos() -> list[tuple[str, str, list[str]]]:
    """(repo, preset, roles) for every hub repo some preset loads, in preset order."""
    rows: dict[tuple[str, str], list[str]] = {}
    for preset in PRESETS.values():
        if preset.sources is not None:
            for role in ("drafter", "target", "vae", "text_encoder", "reward", "reward_tokenizer"):
                rows.setdefault((getattr(preset.sources, role).repo_id, preset.name), []).append(role)
    for repo, (preset, roles) in PUBLISHED.items():
        rows.setdefault((repo, preset), []).extend(roles)
    return [(repo, preset, roles) for (repo, preset), roles in rows.items()]


@dataclass(frozen=True)
class HubAccess:
    """How the hub is reached for one load or download: the cache folder (None: huggingface_hub's,
    `HF_HUB_CACHE` / `HF_HOME`), the token (None: huggingface_hub's, `HF_TOKEN` or a stored login) and
    whether only cached files may be used (None: `HF_HUB_OFFLINE`)."""

    cache_dir: str | None = None
    token: str | bool | None = None
    local_files_only: bool | None = None

    def __post_init__(self) -> None:
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", str(Path(self.cache_dir).expanduser()))
            if Path(self.cache_dir).exists() and not Path(self.cache_dir).is_dir():
                raise NotADirectoryError(f"cache_dir {self.cache_dir} is a file; give the folder of a Hugging Face "
                                         "cache (or a new folder to fill)")
        if self.token is not None and not isinstance(self.token, bool) and (not isinstance(self.token, str)
                                                                            or not self.token.strip()):
            raise ValueError("token must be a non-empty string (a Hugging Face access token), True (the stored "
                             "login) or None (HF_TOKEN or the stored login)")
        if self.local_files_only is not None and not isinstance(self.local_files_only, bool):
            raise ValueError(f"local_files_only={self.local_files_only!r}: give True, False or None (HF_HUB_OFFLINE)")

    @property
    def offline(self) -> bool:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE) if self.local_files_only is None else self.local_files_only

    @property
    def cache(self) -> Path:
        """The cache folder files land in."""
        from huggingface_hub import constants

        return Path(self.cache_dir or constants.HF_HUB_CACHE)


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


def parse_source(spec: str, default: HubSource | None, role: str | None = None) -> HubSource | None:
    """A hub source from `org/name[@revision][/path]`, or None when `spec` does not look like one. `org/name`
    alone: the preset default's file or folders when it is the default's repo, the folders `PUBLISHED`
    names for `role` when it is a published repo, else the whole repo."""
    m = _REPO.match(spec)
    if m is None or spec.startswith((".", "/", "~")):
        return None
    repo, rev, path = m.group("repo"), m.group("rev"), m.group("path")
    if path:
        base = HubSource(repo, path)
    elif default is not None and default.repo_id == repo:
        base = default
    elif repo in PUBLISHED and role in PUBLISHED[repo][1]:
        base = PUBLISHED[repo][1][role]
    else:
        base = HubSource(repo)  # the whole repo (a folder)
    return replace(base, revision=rev) if rev else base


def resolve_source(source: HubSource, access: HubAccess = HubAccess()) -> Path:
    """The local path of a hub file or folder (fetched unless offline); raises what huggingface_hub raises."""
    from huggingface_hub import hf_hub_download, snapshot_download

    where = dict(revision=source.revision, local_files_only=access.offline, cache_dir=access.cache_dir,
                 token=access.token)
    if source.filename is not None:
        return Path(hf_hub_download(source.repo_id, source.filename, **where))
    folder = Path(snapshot_download(source.repo_id, allow_patterns=list(source.patterns) or None, **where))
    if source.patterns and not any(any(folder.glob(p)) for p in source.patterns):
        raise FileNotFoundError(f"no file of {source.repo_id} matches {list(source.patterns)} in {folder}")
    return folder


def resolve_components(specs: dict[str, str | Path | None], defaults: dict[str, HubSource | None],
                       access: HubAccess = HubAccess(), preset: str | None = None) -> dict:
    """{role: local path or None} for every role of `specs`: a local path is kept, a hub spec (or None
    with a preset default) is resolved. Every missing file is collected and reported together, with
    `sdvg download PRESET` for the files of `preset` (a preset name) that are its published defaults."""
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
            source = parse_source(str(spec), default, role)
            if source is None:
                raise FileNotFoundError(f"{role}: {spec} is neither a local file or folder nor a hub repo id "
                                        "(org/name[@revision][/path/in/repo])")
        try:
            out[role] = resolve_source(source, access)
        except Exception as exc:  # huggingface_hub's not-cached / not-found / offline errors
            if not _is_missing(exc):
                raise
            missing.append(Missing(role, source, type(exc).__name__))
    if missing:
        raise MissingWeightsError(missing_message(missing, defaults, access, preset))
    return out


def missing_message(missing: list[Missing], defaults: dict[str, HubSource | None], access: HubAccess,
                    preset: str | None) -> str:
    """What is missing, and the commands that fetch it: one `sdvg download PRESET` for the preset's own
    files, one `hf download` line for each other file."""
    lines = [f"  {m.role}: {m.source.repo_id} {m.source.filename or list(m.source.patterns)} "
             f"(revision {m.source.revision}; {m.reason})" for m in missing]
    published = preset in PRESETS and PRESETS[preset].sources is not None
    own = [m for m in missing if published and m.source == defaults.get(m.role)
           and m.source == getattr(PRESETS[preset].sources, m.role)]
    cache = f" --cache-dir {access.cache_dir}" if access.cache_dir else ""
    fetch = [f"  sdvg download {preset}{cache}"] if own else []
    fetch += [f"  {m.fetch_command()}{cache}" for m in missing if m not in own]
    return ("weights not found in the Hugging Face cache " + f"({access.cache}):\n" + "\n".join(lines)
            + "\nfetch them (online) with:\n" + "\n".join(fetch) + "\nor pass local paths for these components")


def _is_missing(exc: Exception) -> bool:
    from huggingface_hub import errors

    kinds = tuple(getattr(errors, n) for n in ("LocalEntryNotFoundError", "EntryNotFoundError",
                                                "RepositoryNotFoundError", "RevisionNotFoundError",
                                                "OfflineModeIsEnabled") if hasattr(errors, n))
    return isinstance(exc, kinds) or isinstance(exc, FileNotFoundError)
