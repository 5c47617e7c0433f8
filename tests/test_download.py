"""`sdvg download` and from_pretrained's hub keywords, against a hub on 127.0.0.1 (tests/fake_hub_server.py)
that serves the tests' tiny checkpoints under the repo and file names the `wan2.1` preset loads: the plan
and its sizes before any file moves, what the load then reads offline, resumes, and the refusals."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fake_hub_server import FakeHub
from sdvg.config import HubSource, PresetSources, get_preset
from sdvg.models.hub import HubAccess, MissingWeightsError, resolve_components

ROLES = ("drafter", "target", "vae", "text_encoder", "reward", "reward_tokenizer")
TARGET_FILE = "krea-realtime-video-14b.safetensors"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tiny_pipe):
    from conftest import write_real_checkpoints

    src = tmp_path_factory.mktemp("tiny")
    return write_real_checkpoints(tiny_pipe.components, src)


def wan_repos(paths) -> dict[str, dict[str, bytes]]:
    """The wan2.1 preset's repos, holding the tiny checkpoints under the real names, plus files no
    component takes (they must not be fetched)."""
    def folder(p):
        return {f.name: f.read_bytes() for f in sorted(Path(p).iterdir()) if f.is_file()}

    return {
        "gdhe17/Self-Forcing": {"checkpoints/self_forcing_dmd.pt": paths["drafter"].read_bytes(),
                                "README.md": b"# not a component\n"},
        "krea/krea-realtime-video": {TARGET_FILE: paths["target"].read_bytes()},
        "Wan-AI/Wan2.1-T2V-1.3B": {
            "Wan2.1_VAE.pth": (paths["vae"] / "diffusion_pytorch_model.safetensors").read_bytes(),
            "models_t5_umt5-xxl-enc-bf16.pth": b"umt5" * 1000,
            **{f"google/umt5-xxl/{k}": v for k, v in folder(paths["text_encoder"] / "tokenizer").items()},
            "diffusion_pytorch_model.safetensors": b"\0" * 5000},
        "THUDM/ImageReward": {"ImageReward.pt": paths["reward"].read_bytes()},
        "google-bert/bert-base-uncased": {**folder(paths["reward_tokenizer"]), "vocab.txt": b"[PAD]\n[UNK]\n",
                                          "config.json": b"{}", "model.safetensors": b"\0" * 3000},
    }


@pytest.fixture
def hub(tiny_files):
    fake = FakeHub()
    for repo, files in wan_repos(tiny_files).items():
        fake.add(repo, files)
    fake.url = fake.start()
    yield fake
    fake.stop()


# `sdvg download ...`, and a check that it never imported torch (it fetches files; it loads no model)
DOWNLOAD = ("import sys\nfrom sdvg.cli import main\ncode = main(['download', *sys.argv[1:]])\n"
            "assert 'torch' not in sys.modules, 'sdvg download imported torch'\nsys.exit(code)")


def sdvg_download(hub: FakeHub, home: Path, *args: str) -> subprocess.CompletedProcess:
    """`sdvg download ...` in a fresh interpreter that reaches only the fake hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1")
    r = subprocess.run([sys.executable, "-c", DOWNLOAD, *args], env=env, capture_output=True, text=True, timeout=120)
    assert "imported torch" not in r.stderr
    return r


def test_download_shows_the_plan_then_fetches_what_the_load_reads(hub, tiny_files, tmp_path):
    r = sdvg_download(hub, tmp_path, "wan2.1", "--quiet")
    assert r.returncode == 0, r.stderr
    served = wan_repos(tiny_files)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("preset wan2.1: 6 component(s)") and str(tmp_path / "hub") in lines[0]
    target = len(served["krea/krea-realtime-video"][TARGET_FILE])
    assert any(ln.split()[:2] == ["target", "krea/krea-realtime-video@main"] and f"{target / 1e3:.2f} kB" in ln
               and ln.endswith("to fetch") for ln in lines)
    asked = ["/api/models/" in path for _, path, _ in hub.log]
    assert asked.count(True) == 5 and asked == sorted(asked, reverse=True)  # every repo's sizes before any file
    assert hub.gets("README.md") == [] and hub.gets("model.safetensors") == []  # no component takes them
    assert hub.gets("/diffusion_pytorch_model.safetensors") == []
    # what from_pretrained resolves, offline, is what was served
    sources = get_preset("wan2.1").sources
    paths = resolve_components({role: None for role in ROLES}, {role: getattr(sources, role) for role in ROLES},
                               HubAccess(cache_dir=str(tmp_path / "hub"), local_files_only=True), "wan2.1")
    assert paths["target"].read_bytes() == served["krea/krea-realtime-video"][TARGET_FILE]
    assert (paths["text_encoder"] / "models_t5_umt5-xxl-enc-bf16.pth").is_file()
    assert sorted(p.name for p in paths["reward_tokenizer"].iterdir()) == sorted(
        n for n in served["google-bert/bert-base-uncased"] if n != "model.safetensors")
    assert "now load offline" in r.stderr


def test_a_broken_transfer_resumes_where_it_broke_and_a_rerun_fetches_only_what_is_missing(hub, tiny_files,
                                                                                             tmp_path):
    # huggingface_hub writes what it receives in chunks of 10 MiB: a file of 24 MiB whose transfer breaks
    # at 15 MiB is resumed from the chunk it completed
    data = bytes(range(256)) * (24 * 4096)
    hub.repos["krea/krea-realtime-video"].files[TARGET_FILE] = data
    hub.repos["krea/krea-realtime-video"].drop_after[TARGET_FILE] = 15 * 2**20  # the connection closes there
    r = sdvg_download(hub, tmp_path, "krea/krea-realtime-video", "--quiet")
    assert r.returncode == 0, r.stderr
    first, resumed = hub.gets(TARGET_FILE)
    assert first is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 15 * 2**20  # not from 0
    snapshot = next((tmp_path / "hub" / "models--krea--krea-realtime-video" / "snapshots").iterdir())
    assert (snapshot / TARGET_FILE).read_bytes() == data
    assert "component(s)" in r.stdout and "drafter" not in r.stdout  # the repo's components only: the target

    hub.log.clear()  # the whole preset now: the target is cached, everything else is fetched
    again = sdvg_download(hub, tmp_path, "wan2.1", "--quiet")
    assert again.returncode == 0, again.stderr
    assert hub.gets(TARGET_FILE) == [] and hub.gets("self_forcing_dmd.pt") == [None]
    assert any(ln.split()[0] == "target" and ln.endswith("cached") for ln in again.stdout.splitlines()[1:])
    hub.log.clear()
    third = sdvg_download(hub, tmp_path, "wan2.1", "--quiet")
    assert third.returncode == 0 and [path for m, path, _ in hub.log if m == "GET" and "/resolve/" in path] == []
    assert "to fetch 0 B" in third.stdout


def test_too_little_disk_is_refused_before_any_file_moves(hub, tmp_path):
    hub.repos["krea/krea-realtime-video"].declared[TARGET_FILE] = 2 ** 62  # more than any disk holds
    listed = sdvg_download(hub, tmp_path, "wan2.1", "--dry-run")  # lists, fetches nothing
    assert listed.returncode == 0 and "to fetch 4611686018.43 GB into" in listed.stdout and "free)" in listed.stdout
    r = sdvg_download(hub, tmp_path, "wan2.1")
    assert r.returncode == 2 and "4611686018.43 GB to fetch but" in r.stderr
    assert "to fetch but" in r.stderr and "free on the disk of" in r.stderr and "--cache-dir DIR" in r.stderr
    assert [m for m, path, _ in hub.log if "/resolve/" in path] == []


def test_the_hub_refusals_name_the_repo_and_the_fix(hub, tmp_path):
    hub.repos["THUDM/ImageReward"].token = "hf_secret"  # gated: only this token reaches it
    r = sdvg_download(hub, tmp_path, "THUDM/ImageReward")
    assert r.returncode == 2 and "THUDM/ImageReward is gated" in r.stderr and "--token" in r.stderr
    r = sdvg_download(hub, tmp_path, "THUDM/ImageReward", "--token", "hf_secret", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "hf_secret" not in r.stdout + r.stderr  # a token is never echoed
    r = sdvg_download(hub, tmp_path, "krea/krea-realtime-video", "--revision", "v9")
    assert r.returncode == 2 and "krea/krea-realtime-video has no revision 'v9'" in r.stderr
    del hub.repos["gdhe17/Self-Forcing"]
    hub.log.clear()
    r = sdvg_download(hub, tmp_path, "wan2.1")
    assert r.returncode == 2 and "the hub has no repo gdhe17/Self-Forcing" in r.stderr
    assert [m for m, path, _ in hub.log if m == "GET" and "/resolve/" in path] == []  # refused before any file


def test_names_no_preset_loads_are_refused_before_the_hub_is_asked(capsys, monkeypatch):
    from huggingface_hub import constants

    from sdvg.cli import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: asking it would fail
    for name, says in (("org/unknown", "'org/unknown' is neither a preset nor a hub repo a preset loads; presets "
                                       "with published weights: wan2.1; repos: THUDM/ImageReward"),
                       ("wan21", "(did you mean 'wan2.1'?)"),
                       ("tiny", "preset 'tiny' has random weights: there is nothing to download"),
                       ("krea/krea-realtime-vide", "(did you mean 'krea/krea-realtime-video'?)")):
        assert main(["download", name]) == 2
        assert says in capsys.readouterr().err
    assert main(["download", "wan2.1", "--revision", "v2"]) == 2
    assert "--revision v2 would apply to 5 repos" in capsys.readouterr().err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["download", "wan2.1"]) == 2
    assert "HF_HUB_OFFLINE=1 is set, so nothing can be fetched" in capsys.readouterr().err


def test_an_unreachable_hub_is_a_runtime_failure_that_says_rerun(tmp_path):
    unreachable = FakeHub()
    unreachable.url = "http://127.0.0.1:9"
    r = sdvg_download(unreachable, tmp_path, "wan2.1")
    assert r.returncode == 1 and "cannot reach the hub at http://127.0.0.1:9" in r.stderr and "rerun" in r.stderr


def test_from_pretrained_reads_the_cache_it_is_given_and_names_the_download(tiny_files, tiny_pipe, tiny_preset,
                                                                              tmp_path, monkeypatch):
    from huggingface_hub import constants
    from test_hub import add_repo

    from sdvg import SpeculativeVideoPipeline

    cache = tmp_path / "elsewhere"
    add_repo(cache, "test-org/drafter", {"self_forcing.pt": tiny_files["drafter"]})
    add_repo(cache, "test-org/target", {"krea.safetensors": tiny_files["target"]})
    add_repo(cache, "test-org/vae", {f"vae/{p.name}": p for p in tiny_files["vae"].iterdir()})
    add_repo(cache, "test-org/reward", {"ImageReward.pt": tiny_files["reward"]})
    add_repo(cache, "test-org/bert", {p.name: p for p in tiny_files["reward_tokenizer"].iterdir()})
    add_repo(cache, "test-org/wan", {f"{d}/{p.name}": p for d in ("text_encoder", "tokenizer")
                                     for p in (tiny_files["text_encoder"] / d).iterdir()})
    preset = dataclasses.replace(tiny_preset, sources=PresetSources(
        drafter=HubSource("test-org/drafter", "self_forcing.pt"),
        target=HubSource("test-org/target", "krea.safetensors"),
        vae=HubSource("test-org/vae", patterns=("vae/*",)),
        text_encoder=HubSource("test-org/wan", patterns=("text_encoder/*", "tokenizer/*")),
        reward=HubSource("test-org/reward", "ImageReward.pt"),
        reward_tokenizer=HubSource("test-org/bert", patterns=("*",))))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))  # the default cache holds nothing
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    pipe = SpeculativeVideoPipeline.from_pretrained(preset, cache_dir=cache, local_files_only=True,
                                                    drafter_device="cpu", progress=False)
    for mine, theirs in zip(pipe.target.parameters(), tiny_pipe.target.parameters()):
        assert torch.equal(mine, theirs)
    with pytest.raises(MissingWeightsError, match="test-org/target krea.safetensors"):
        SpeculativeVideoPipeline.from_pretrained(preset, local_files_only=True, drafter_device="cpu")
    with pytest.raises(ValueError) as e:
        SpeculativeVideoPipeline.from_pretrained(preset, token="", drafter_device="cpu")
    assert "token" in str(e.value)
    with pytest.raises(NotADirectoryError, match="is a file"):
        SpeculativeVideoPipeline.from_pretrained(preset, cache_dir=tiny_files["drafter"], drafter_device="cpu")
    # the wan2.1 preset's own files: one `sdvg download` line, with the cache it was given
    with pytest.raises(MissingWeightsError) as exc:
        SpeculativeVideoPipeline.from_pretrained("wan2.1", cache_dir=tmp_path / "new", local_files_only=True,
                                                 drafter_device="cpu")
    msg = str(exc.value)
    assert f"fetch them (online) with:\n  sdvg download wan2.1 --cache-dir {tmp_path / 'new'}\nor pass" in msg
    assert msg.count("  drafter: gdhe17/Self-Forcing") == 1 and "hf download" not in msg
