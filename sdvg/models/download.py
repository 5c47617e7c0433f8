"""Fetching a preset's published weights into the Hugging Face cache (`sdvg download`): the plan (every
file of every component, its size and whether the cache holds it, from one metadata request per repo),
the disk-space check against that plan, then the files through `huggingface_hub.hf_hub_download`, which
resumes a file an earlier run left incomplete and skips the ones already cached.

What `from_pretrained` loads is what lands here: the same repos, revisions and file patterns
(`sdvg.models.hub`), so after a download the load runs offline."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sdvg.config import PRESETS, HubSource
from sdvg.models.hub import HubAccess, preset_for

ROLES = ("drafter", "target", "vae", "text_encoder", "reward", "reward_tokenizer")


class DownloadRefused(ValueError):
    """Bad input found before anything is fetched (exit 2): an unknown or random-weight preset, a repo,
    revision or file the hub does not have, a token it refuses, too little disk space."""


@dataclass(frozen=True)
class RepoFile:
    path: str  # inside the repo
    size: int | None  # bytes; None when the hub does not say
    cached: bool


@dataclass(frozen=True)
class ComponentPlan:
    """One component of a preset: where it comes from, the commit its revision names now, its files."""

    role: str
    source: HubSource
    commit: str
    files: tuple[RepoFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)

    @property
    def to_fetch(self) -> int:
        return sum(f.size or 0 for f in self.files if not f.cached)


def preset_sources(name: str, revision: str | None = None) -> tuple[str, dict[str, HubSource]]:
    """(preset name, {role: source}) that `sdvg download NAME` fetches: every component of a preset with
    published weights, or the components a published repo (`org/name[@revision]`) gives its preset.
    `revision` replaces the revision of every one of them (refused when they span several repos)."""
    from sdvg.config import ConfigError
    from sdvg.models.hub import parse_source

    try:
        preset, repo_specs = preset_for(name)
    except ConfigError:
        raise DownloadRefused(unknown_message(name)) from None
    sources = PRESETS[preset].sources
    if sources is None:
        published = sorted(k for k, v in PRESETS.items() if v.sources is not None)
        raise DownloadRefused(f"preset {preset!r} has random weights: there is nothing to download (it builds its "
                              f"models at load); presets with published weights: {', '.join(published)}")
    out = {role: getattr(sources, role) for role in ROLES}
    if repo_specs:
        out = {role: parse_source(spec, out[role], role) for role, spec in repo_specs.items()}
    if revision is not None:
        repos = sorted({s.repo_id for s in out.values()})
        if len(repos) > 1:
            raise DownloadRefused(f"--revision {revision} would apply to {len(repos)} repos ({', '.join(repos)}); "
                                  f"name one of them instead, e.g. sdvg download {repos[0]} --revision {revision}")
        out = {role: HubSource(s.repo_id, s.filename, s.patterns, revision) for role, s in out.items()}
    return preset, out


def unknown_message(name: str) -> str:
    """A name that is neither a preset nor a repo a preset loads: the presets, the repos, the closest."""
    from sdvg.models.hub import published_repos
    from sdvg.names import did_you_mean

    repos = sorted({repo for repo, _, _ in published_repos()})
    published = sorted(k for k, v in PRESETS.items() if v.sources is not None)
    return (f"{name!r} is neither a preset nor a hub repo a preset loads{did_you_mean(name, [*PRESETS, *repos])}; "
            f"presets with published weights: {', '.join(published)}; repos: {', '.join(repos)}")


def plan(sources: dict[str, HubSource], access: HubAccess) -> list[ComponentPlan]:
    """Every file of every component, with its size and whether the cache holds it, from one metadata
    request per (repo, revision). A repo, revision or file the hub does not have is refused by name."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.utils import filter_repo_objects

    if access.offline:
        raise DownloadRefused("HF_HUB_OFFLINE=1 is set, so nothing can be fetched; run `HF_HUB_OFFLINE=0 sdvg "
                              "download ...` (or unset it) on a machine that reaches the hub")
    api = HfApi()
    infos: dict[tuple[str, str], tuple[str, dict[str, int | None]]] = {}
    out = []
    for role, source in sources.items():
        key = (source.repo_id, source.revision)
        if key not in infos:
            infos[key] = _repo_files(api, source, access)
        commit, sizes = infos[key]
        if source.filename is not None:
            if source.filename not in sizes:
                raise DownloadRefused(f"{role}: {source.repo_id} has no file {source.filename!r} at revision "
                                      f"{source.revision} (commit {commit[:12]}); give the component's file by "
                                      f"flag or API keyword, or another revision")
            paths = [source.filename]
        else:
            paths = sorted(filter_repo_objects(list(sizes), allow_patterns=list(source.patterns) or None))
            if not paths:
                raise DownloadRefused(f"{role}: no file of {source.repo_id} at revision {source.revision} matches "
                                      f"{list(source.patterns)}")
        files = tuple(RepoFile(p, sizes[p], isinstance(try_to_load_from_cache(
            source.repo_id, p, cache_dir=access.cache_dir, revision=commit), str)) for p in paths)
        out.append(ComponentPlan(role, source, commit, files))
    return out


def _repo_files(api, source: HubSource, access: HubAccess) -> tuple[str, dict[str, int | None]]:
    """(commit, {path: size}) of a repo at a revision; the hub's refusals as DownloadRefused."""
    from huggingface_hub import errors

    where = f"{source.repo_id} at revision {source.revision}"
    try:
        info = api.model_info(source.repo_id, revision=source.revision, files_metadata=True, token=access.token)
    except errors.GatedRepoError:
        raise DownloadRefused(f"{source.repo_id} is gated: accept its licence on its model card "
                              f"(https://huggingface.co/{source.repo_id}), then pass --token (or set HF_TOKEN, or "
                              "run `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise DownloadRefused(f"{source.repo_id} has no revision {source.revision!r}; give a branch, tag or commit "
                              "it has (--revision)") from None
    except errors.RepositoryNotFoundError:
        raise DownloadRefused(f"the hub has no repo {source.repo_id} (or it is private and the token does not reach "
                              "it): check the name, or pass --token") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise DownloadRefused(f"the hub refused the token for {where} (HTTP {status}); pass a valid --token "
                                  "(or set HF_TOKEN)") from None
        raise
    return info.sha, {s.rfilename: s.size for s in info.siblings or ()}


def free_bytes(folder: Path) -> int:
    """Free space on the file system that holds `folder` (or would: its nearest existing parent)."""
    probe = folder.expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_space(plans: list[ComponentPlan], access: HubAccess) -> None:
    """Refuse before anything is fetched when the files still to fetch do not fit the cache's disk."""
    need = sum(p.to_fetch for p in plans)
    free = free_bytes(access.cache)
    if need > free:
        raise DownloadRefused(f"{human_bytes(need)} to fetch but {human_bytes(free)} free on the disk of "
                              f"{access.cache}; free {human_bytes(need - free)} there, or fetch into a cache on "
                              "another disk (--cache-dir DIR, then HF_HUB_CACHE=DIR or from_pretrained(cache_dir=DIR))")


def fetch(plans: list[ComponentPlan], access: HubAccess, progress: bool = True) -> list[Path]:
    """Every planned file into the cache at its component's revision (so `refs/<revision>` names the commit
    the load reads); a cached file costs one metadata request, an incomplete one is resumed."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    if not progress:
        disable_progress_bars()
    try:
        return [Path(hf_hub_download(p.source.repo_id, f.path, revision=p.source.revision, cache_dir=access.cache_dir,
                                     token=access.token)) for p in plans for f in p.files]
    finally:
        if not progress:
            enable_progress_bars()


def describe(preset: str, plans: list[ComponentPlan], access: HubAccess) -> list[str]:
    """The plan as a person reads it: the total, then per component its repo, revision, commit, files,
    size and what the cache holds."""
    need = sum(p.to_fetch for p in plans)
    lines = [f"preset {preset}: {len(plans)} component(s), {human_bytes(sum(p.size for p in plans))}; to fetch "
             f"{human_bytes(need)} into {access.cache} ({human_bytes(free_bytes(access.cache))} free)"]
    for p in plans:
        what = p.source.filename or f"{len(p.files)} files of {list(p.source.patterns)}"
        cached = sum(f.cached for f in p.files)
        state = "cached" if cached == len(p.files) else f"{human_bytes(p.to_fetch)} to fetch" + (
            f" ({cached} of {len(p.files)} files cached)" if cached else "")
        lines.append(f"  {p.role:16} {p.source.repo_id}@{p.source.revision} ({p.commit[:12]}) {what}: "
                     f"{human_bytes(p.size)}, {state}")
    return lines


@contextmanager
def reaching_the_hub():
    """A failure to reach the hub (no network, a refused connection, a dropped transfer) becomes a
    ConnectionError (exit 1) that says a rerun resumes: what was fetched stays in the cache. The transport
    is huggingface_hub's (httpx or httpx2 by version), so its errors are known by class name."""
    try:
        yield
    except Exception as exc:
        if not {c.__name__ for c in type(exc).__mro__} & {"TransportError", "LocalEntryNotFoundError"}:
            raise
        from huggingface_hub import constants

        raise ConnectionError(f"cannot reach the hub at {constants.ENDPOINT} ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}); check the network (and HF_ENDPOINT), then rerun: "
                              "the files fetched stay cached and an incomplete one is resumed") from exc


def human_bytes(n: int) -> str:
    """A size in decimal units, as the hub shows them (GB = 10^9 bytes)."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
