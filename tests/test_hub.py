"""Hub-aware loading, offline, against a Hugging Face cache folder built in the real layout
(blobs/, snapshots/<commit>/, refs/main) in a temporary HF_HOME."""
import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdvg.config import HubSource, PresetSources
from sdvg.models.hub import MissingWeightsError, parse_source, resolve_components

PROMPT = "a red fox running through fresh snow"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_repo(hub: Path, repo_id: str, files: dict[str, Path], commit: str = COMMIT, ref: str = "main") -> None:
    """Put `files` (path in repo -> local file) into the cache as huggingface_hub lays it out."""
    root = hub / ("models--" + repo_id.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory, tiny_pipe):
    """The tiny pipeline's weights written in their real formats, then placed in a fake HF cache."""
    from conftest import write_real_checkpoints

    src = tmp_path_factory.mktemp("src")
    write_real_checkpoints(tiny_pipe.components, src)
    home = tmp_path_factory.mktemp("hf_home")
    hub = home / "hub"
    add_repo(hub, "test-org/drafter", {"checkpoints/self_forcing.pt": src / "self_forcing.pt"})
    add_repo(hub, "test-org/target", {"krea.safetensors": src / "krea.safetensors"})
    add_repo(hub, "test-org/vae", {f"vae/{p.name}": p for p in (src / "vae").iterdir()})
    add_repo(hub, "test-org/reward", {"ImageReward.pt": src / "ImageReward.pt"})
    add_repo(hub, "test-org/bert", {p.name: p for p in (src / "bert").iterdir()})
    add_repo(hub, "test-org/wan", {f"{d}/{p.name}": p for d in ("text_encoder", "tokenizer")
                                   for p in (src / "wan" / d).iterdir()})
    sources = PresetSources(
        drafter=HubSource("test-org/drafter", "checkpoints/self_forcing.pt"),
        target=HubSource("test-org/target", "krea.safetensors"),
        vae=HubSource("test-org/vae", patterns=("vae/*",)),
        text_encoder=HubSource("test-org/wan", patterns=("text_encoder/*", "tokenizer/*")),
        reward=HubSource("test-org/reward", "ImageReward.pt"),
        reward_tokenizer=HubSource("test-org/bert", patterns=("*",)),
    )
    return home, src, sources


@pytest.fixture
def offline_cache(fake_hub, monkeypatch):
    from huggingface_hub import constants

    home, _, _ = fake_hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return fake_hub


@pytest.mark.slow
def test_repo_ids_load_the_same_weights_as_explicit_paths(offline_cache, tiny_pipe, tiny_preset):
    from sdvg import SpeculativeVideoPipeline

    _, src, sources = offline_cache
    preset = dataclasses.replace(tiny_preset, sources=sources)
    by_preset = SpeculativeVideoPipeline.from_pretrained(preset, drafter_device="cpu")  # every file from the cache
    by_paths = SpeculativeVideoPipeline.from_pretrained(
        tiny_preset, drafter=src / "self_forcing.pt", target=src / "krea.safetensors", vae=src / "vae",
        reward=src / "ImageReward.pt", text_encoder=src / "wan", reward_tokenizer=src / "bert", drafter_device="cpu")
    by_ids = SpeculativeVideoPipeline.from_pretrained(
        tiny_preset, drafter="test-org/drafter/checkpoints/self_forcing.pt", target="test-org/target/krea.safetensors",
        vae="test-org/vae", reward=f"test-org/reward@{COMMIT}/ImageReward.pt", text_encoder="test-org/wan",
        reward_tokenizer="test-org/bert", drafter_device="cpu")
    kw = dict(tau=-0.105, num_blocks=2, seed=4, output_type="uint8")
    want = by_paths(PROMPT, **kw)
    for pipe in (by_preset, by_ids):
        got = pipe(PROMPT, **kw)
        assert torch.equal(got.latents, want.latents) and torch.equal(got.frames, want.frames)
    assert by_ids.sources["drafter"].startswith("self_forcing.pt@")


def test_missing_files_are_named_with_the_fetch_command(offline_cache, tiny_preset):
    from sdvg import SpeculativeVideoPipeline

    _, _, sources = offline_cache
    bad = dataclasses.replace(sources, target=HubSource("test-org/target", "krea-v2.safetensors"),
                              reward=HubSource("nobody/nothing", "ImageReward.pt"))
    with pytest.raises(MissingWeightsError) as exc:
        SpeculativeVideoPipeline.from_pretrained(dataclasses.replace(tiny_preset, sources=bad), drafter_device="cpu")
    msg = str(exc.value)
    assert "target: test-org/target krea-v2.safetensors" in msg and "reward: nobody/nothing ImageReward.pt" in msg
    assert "download test-org/target krea-v2.safetensors" in msg and "drafter" not in msg.split("fetch")[0]


def test_specs_that_are_neither_paths_nor_repos(offline_cache, tiny_preset):
    from sdvg import SpeculativeVideoPipeline

    with pytest.raises(FileNotFoundError) as e:
        resolve_components({"vae": "./no/such/file.pth"}, {})
    assert all(s in str(e.value) for s in ("./no/such/file.pth", "hub repo id")), e.value
    with pytest.raises(ValueError) as e:
        SpeculativeVideoPipeline.from_pretrained(tiny_preset, vae="test-org/vae", drafter_device="cpu")
    assert all(s in str(e.value) for s in ("'tiny'", "drafter, target")), e.value


def test_parse_source():
    default = HubSource("a/b", "x.pt")
    assert parse_source("a/b", default) == default
    assert parse_source("a/b@v2", default) == HubSource("a/b", "x.pt", revision="v2")
    assert parse_source("a/b/dir/y.pt", default) == HubSource("a/b", "dir/y.pt")
    assert parse_source("c/d", default) == HubSource("c/d")
    assert parse_source("./a/b", default) is None and parse_source("plainname", default) is None


@pytest.mark.slow
def test_cli_resolves_repo_ids_offline(offline_cache, tmp_path, capsys):
    home, _, _ = offline_cache
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    flags = ["--drafter", "test-org/drafter/checkpoints/self_forcing.pt", "--target", "test-org/target/krea.safetensors",
             "--vae", "test-org/vae", "--reward", "test-org/reward/ImageReward.pt", "--text-encoder", "test-org/wan",
             "--reward-tokenizer", "test-org/bert"]
    r = subprocess.run([sys.executable, "-m", "sdvg.cli", "generate", "--preset", "tiny", *flags, "--prompt", PROMPT,
                        "--num-blocks", "1", "--quiet", "--out", str(tmp_path / "v.mp4")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # a file the cache lacks: through the command's main() in this process (offline_cache points the hub
    # library at the same cache, offline, as HF_HOME and HF_HUB_OFFLINE did for the process above)
    from sdvg.cli.main import main

    capsys.readouterr()
    code = main(["generate", "--preset", "tiny", *flags[:2], "--target", "test-org/target/missing.safetensors",
                 "--prompt", PROMPT, "--quiet", "--out", str(tmp_path / "w.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and "missing.safetensors" in err and "download" in err


def test_published_repo_ids_give_their_preset(offline_cache):
    from sdvg import SpeculativeVideoPipeline
    from sdvg.config import ConfigError, get_preset
    from sdvg.models.hub import preset_for

    assert preset_for("tiny") == ("tiny", {})
    assert preset_for("Wan-AI/Wan2.1-T2V-1.3B") == ("wan2.1", {"vae": "Wan-AI/Wan2.1-T2V-1.3B",
                                                               "text_encoder": "Wan-AI/Wan2.1-T2V-1.3B"})
    assert preset_for("gdhe17/Self-Forcing") == ("wan2.1", {"drafter": "gdhe17/Self-Forcing"})
    assert preset_for("krea/krea-realtime-video@v1") == ("wan2.1", {"target": "krea/krea-realtime-video@v1"})
    assert preset_for("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")[0] == "wan2.1"
    sources = get_preset("wan2.1").sources  # the umT5 and the VAE from the one Wan release repo, as it ships
    assert sources.vae.repo_id == sources.text_encoder.repo_id == "Wan-AI/Wan2.1-T2V-1.3B"
    assert parse_source("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", sources.text_encoder, "text_encoder") == HubSource(
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", patterns=("text_encoder/*", "tokenizer/*"))

    with pytest.raises(MissingWeightsError) as exc:  # the wan2.1 preset; nothing of it is cached here
        SpeculativeVideoPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B", drafter_device="cpu")
    msg = str(exc.value)
    assert "text_encoder: Wan-AI/Wan2.1-T2V-1.3B ['models_t5_umt5-xxl-enc-bf16.pth', 'google/umt5-xxl/*']" in msg
    assert "vae: Wan-AI/Wan2.1-T2V-1.3B Wan2.1_VAE.pth" in msg and "target: krea/krea-realtime-video" in msg
    with pytest.raises(ConfigError) as e:
        SpeculativeVideoPipeline.from_pretrained("org/unknown", drafter_device="cpu")
    assert all(s in str(e.value) for s in ("'org/unknown'", "wan2.1", "gdhe17/Self-Forcing",
                                           "from_pretrained('wan2.1', target='org/unknown')")), e.value


def test_wan_release_layout_resolves_from_the_cache(offline_cache, tmp_path):
    from test_umt5_original_format import PROMPT as TEXT, _wan_folder

    from sdvg.config import get_preset
    from sdvg.models.text_encoder import TextEncoder
    from sdvg.models.tokenizers import tiny_umt5_tokenizer

    home, _, _ = offline_cache
    source = TextEncoder.random(get_preset("tiny").text_encoder, tiny_umt5_tokenizer(), seed=4)
    folder, _ = _wan_folder(tmp_path, source)
    add_repo(home / "hub", "test-org/wan21", {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()})
    spec = HubSource("test-org/wan21", patterns=("models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/*"))
    path = resolve_components({"text_encoder": None}, {"text_encoder": spec})["text_encoder"]
    loaded = TextEncoder.from_pretrained(path, config=source.config)
    assert torch.equal(loaded.encode(TEXT), source.encode(TEXT))
