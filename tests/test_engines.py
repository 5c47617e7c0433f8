"""build_engines: the CLI, the engine cache and its validation, TensorRT (marked)."""
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from sdvg.engines.cache import (CorruptEngineError, EngineCache, EngineKey, MissingEngineError, StaleEngineError,
                                 weights_fingerprint)

CMD = "python -m build_engines --preset tiny"


def _key(**changes):
    base = EngineKey(stage="target_dit", config_hash="abc", weights_hash="w1",
                     shapes=(("latents", (1, 16, 3, 8, 8), "float32"),), precision="bf16", gpu_name="NVIDIA H200",
                     compute_capability="9.0", trt_version="11.0.0")
    return dataclasses.replace(base, **changes)


@pytest.fixture
def cache(tmp_path):
    c = EngineCache(tmp_path / "engines")
    art = tmp_path / "engine.plan"
    art.write_bytes(b"plan-bytes" * 100)
    c.store(_key(), art, CMD)
    return c


def test_stored_engine_loads(cache):
    path = cache.load(_key(), CMD)
    assert path.read_bytes().startswith(b"plan-bytes")
    m = json.loads((path.parent / "manifest.json").read_text())
    assert m["key"]["gpu_name"] == "NVIDIA H200" and m["rebuild_command"] == CMD


@pytest.mark.parametrize("field,value", [
    ("config_hash", "def"), ("weights_hash", "w2"), ("shapes", (("latents", (1, 16, 3, 16, 16), "float32"),)),
    ("precision", "fp16"), ("gpu_name", "NVIDIA A100"), ("compute_capability", "8.0"), ("trt_version", "10.9"),
])
def test_stale_or_foreign_engine_refused_with_reason(cache, field, value):
    with pytest.raises(StaleEngineError) as err:
        cache.load(_key(**{field: value}), CMD)
    msg = str(err.value)
    assert field in msg and "rebuild with: " + CMD in msg


def test_truncated_and_corrupt_files_refused(cache, tmp_path):
    path = cache.load(_key(), CMD)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptEngineError, match="truncated"):
        cache.load(_key(), CMD)
    path.write_bytes(data[:-1] + b"X")
    with pytest.raises(CorruptEngineError, match="SHA-256"):
        cache.load(_key(), CMD)
    (path.parent / "manifest.json").write_text("{not json")
    with pytest.raises(CorruptEngineError, match="unreadable"):
        cache.load(_key(), CMD)


@pytest.mark.parametrize("field", ["sha256", "size", "file"])
def test_a_manifest_without_a_field_is_refused_by_name(cache, field):
    path = cache.load(_key(), CMD)
    manifest = path.parent / "manifest.json"
    m = json.loads(manifest.read_text())
    del m[field]
    manifest.write_text(json.dumps(m))
    with pytest.raises(CorruptEngineError) as e:
        cache.load(_key(), CMD)
    assert all(s in str(e.value) for s in (field, "rebuild")), e.value


def test_missing_engine_names_the_build_command(tmp_path):
    with pytest.raises(MissingEngineError, match="build it with: " + CMD):
        EngineCache(tmp_path).load(_key(stage="vae_decode"), CMD)


def test_onnx_external_weights_are_stored_and_checked(tmp_path):
    """An ONNX file past 2 GB keeps its weights in `model.onnx.data`: it moves into the entry with the
    model and is checked by size and SHA-256 like it; a manifest may name no other data file."""
    key = _key(artifact="onnx", trt_version="none")
    c = EngineCache(tmp_path / "engines")
    art = tmp_path / "work" / "model.onnx"
    art.parent.mkdir()
    art.write_bytes(b"graph")
    (tmp_path / "work" / "model.onnx.data").write_bytes(b"weights" * 100)
    path = c.store(key, art, CMD)
    data = path.parent / "model.onnx.data"
    assert c.load(key, CMD) == path and data.is_file() and not art.with_name("model.onnx.data").exists()
    data.write_bytes(b"weights" * 99 + b"WEIGHTS")
    with pytest.raises(CorruptEngineError) as e:
        c.load(key, CMD)
    assert all(s in str(e.value) for s in ("model.onnx.data", "SHA-256")), e.value
    m = json.loads((path.parent / "manifest.json").read_text())
    m["data_file"]["file"] = "../../secret"
    (path.parent / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CorruptEngineError, match="may only be model.onnx.data"):
        c.load(key, CMD)


def test_weights_fingerprint_tracks_weights():
    m = torch.nn.Linear(4, 4)
    a = weights_fingerprint(m)
    with torch.no_grad():
        m.weight[0, 0] += 1
    assert weights_fingerprint(m) != a


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "build_engines", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_onnx_verify_and_cache(tiny_onnx_build, tmp_path, capsys):
    """The real command, one process (conftest's `tiny_onnx_build`: `python -m build_engines --preset tiny
    --format onnx --verify --out DIR`, run once for the session): every engine verified and stored."""
    r = tiny_onnx_build.proc
    assert r.returncode == 0, r.stderr
    names = ["drafter_dit_3f", "drafter_dit_3f_cached", "reward_12f", "reward_9f", "target_dit_3f",
             "target_dit_3f_cached", "vae_decode"]
    assert r.stdout.count("(ok, tolerance 1e-04)") == 7  # one line an engine (a cached DiT engine checked at two sizes)
    for name in names:
        assert re.search(rf"^{name}: exported in .*onnxruntime vs eager max error .* \(ok, tolerance 1e-04\)",
                         r.stdout, re.M), (name, r.stdout)
    manifests = sorted(tiny_onnx_build.out.glob("*/manifest.json"))
    assert [m.parent.name.rsplit("-", 1)[0] for m in manifests] == names
    for path in manifests:
        m = json.loads(path.read_text())
        assert m["key"]["artifact"] == "onnx"
        assert m["rebuild_command"].startswith("python -m build_engines --preset tiny")
    # --stages takes several engine families, and the build plan holds their engines only (the export of a --stages
    # subset: test_onnxruntime_backend's checkpoint test)
    from build_engines.__main__ import main

    assert main(["--preset", "tiny", "--format", "onnx", "--stages", "target_dit,vae_decode", "--dry-run",
                 "--out", str(tmp_path)]) == 0
    plan = capsys.readouterr().out
    assert re.findall(r"^  (\S+)\s+cpu\s", plan, re.M) == ["target_dit_3f", "target_dit_3f_cached", "vae_decode"], plan
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_cli_bad_input(capsys):
    from build_engines.__main__ import cli

    def run(*argv):
        try:
            code = cli(list(argv))
        except SystemExit as exc:  # refused by the parser (e.g. --preset): exit 2 all the same
            code = exc.code
        return code, capsys.readouterr().err

    try:
        import tensorrt  # noqa: F401
        have_trt = True
    except Exception:
        have_trt = False
    if not have_trt:
        code, err = run("--preset", "tiny", "--format", "tensorrt")
        assert code == 2 and "pip install 'sdvg[tensorrt]'" in err
    else:
        code, err = run("--preset", "tiny", "--format", "tensorrt", "--device", "cpu")
        assert code == 2 and "TensorRT engines run on CUDA devices" in err
    for device_flag in ("--drafter-device", "--device", "--target-device"):  # generate's flags and the old one
        code, err = run("--preset", "tiny", "--format", "onnx", device_flag, "cuda:7", "--out", "/nonexistent/x")
        assert code == 2 and "cuda:7" in err, err
        if not torch.cuda.is_available():
            assert "use --device cpu" in err
    code, err = run("--preset", "nope", "--format", "onnx")
    assert code == 2 and "unknown preset 'nope'" in err
    code, err = run("--preset", "tiny", "--format", "onnx", "--reward", "/no/such/ImageReward.pt")
    assert code == 2 and "/no/such/ImageReward.pt" in err, err


def test_tensorrt_backend_without_tensorrt_is_a_clear_error(tiny_pipe, tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except Exception:
        pass
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline(tiny_pipe.components, backend="tensorrt", engines=tmp_path)
    with pytest.raises(RuntimeError, match=r"pip install 'sdvg\[tensorrt\]'"):
        pipe("a fox", num_blocks=1)
    with pytest.raises(ValueError, match="needs engines"):
        SpeculativeVideoPipeline(tiny_pipe.components, backend="tensorrt")("a fox", num_blocks=1)


@pytest.mark.tensorrt
def test_tensorrt_engines_match_eager(tmp_path):
    """Builds the tiny engines on this GPU and runs a video through them (needs TensorRT and CUDA)."""
    r = _cli("--preset", "tiny", "--format", "tensorrt", "--drafter-device", "cuda:0", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny", device="cuda:0", engines=tmp_path)
    kw = dict(num_blocks=3, seed=1, router="pattern", pattern=(False, True, False))
    eager = pipe("a red fox", **kw)
    trt = pipe("a red fox", backend="tensorrt", **kw)
    assert (eager.latents - trt.latents).abs().max() < 1e-3
    assert [b["decision"] for b in eager.stats["blocks"]] == [b["decision"] for b in trt.stats["blocks"]]


def test_an_engines_file_is_refused_before_loading(tmp_path, capsys):
    """`--engines` naming a file: exit 2 at parse time (nothing loads), naming the fix; the API says the same."""
    from sdvg.cli import main
    from sdvg.generation.backends import StageRunners

    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"x")

    def fail(args):
        raise AssertionError("a model was loaded")

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--preset", "tiny", "--prompt", "x", "--backend", "onnxruntime", "--engines", str(plan),
              "--out", str(tmp_path / "v.mp4")], load_pipeline=fail)
    assert exit_.value.code == 2 and "is a file, not an engine folder" in capsys.readouterr().err
    with pytest.raises(ValueError) as e:
        StageRunners(SimpleComponents(), "onnxruntime", engines=plan)
    assert all(s in str(e.value) for s in (str(plan), "not an engine folder")), e.value


class SimpleComponents:
    """Just what StageRunners reads before it opens an engine folder."""

    class _Video:
        frames_per_block = 3

        @staticmethod
        def tokens_per_frame(vae, cfg):
            return 1

    preset = type("P", (), {"video": _Video, "vae": None})()
    drafter = target = None
