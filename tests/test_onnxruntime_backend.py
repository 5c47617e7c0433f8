"""The onnxruntime engine backend: the ONNX files `python -m build_engines --format onnx` exports, run
on the CPU execution provider through the validated engine cache. A whole tiny video through them
equals eager (the engine path's executable oracle without TensorRT); a tampered, foreign or
other-precision folder is refused as for TensorRT."""
import json
import shlex
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from sdvg import SpeculativeVideoPipeline  # noqa: E402
from sdvg.engines.cache import CorruptEngineError, MissingEngineError, StaleEngineError  # noqa: E402
from sdvg.generation.backends import StageRunners  # noqa: E402
from sdvg.models.kv_cache import KVCacheSpec  # noqa: E402

# onnxruntime vs eager over a whole video, per precision: latents (max abs), frames (uint8 steps),
# ImageReward scores (max abs). fp32 measured on the tiny preset: latents 1.7e-6, scores 4e-7. The
# fp16/bf16 rows (CUDA execution provider, not run on CPU) follow --verify's per-engine tolerances.
ORT_TOLERANCE = {
    "fp32": {"latents": 1e-4, "frames": 1, "scores": 1e-4},
    "fp16": {"latents": 5e-2, "frames": 4, "scores": 2e-2},
    "bf16": {"latents": 1e-1, "frames": 8, "scores": 5e-2},
}
# Every test here needs the ONNX export of every tiny engine (or builds engines itself): the whole suite only.
pytestmark = pytest.mark.slow

KW = dict(num_blocks=3, seed=1, router="pattern", pattern=(False, True, False))


@pytest.fixture(scope="module")
def engines(tiny_onnx_build):
    """Every tiny engine exported once for the session (`python -m build_engines --format onnx --verify`,
    conftest's `tiny_onnx_build`); read-only here (a test that alters it works on a copy)."""
    assert tiny_onnx_build.proc.returncode == 0, tiny_onnx_build.proc.stderr
    return tiny_onnx_build.out


@pytest.fixture(scope="module")
def ort_pipe(tiny_pipe, engines):
    return SpeculativeVideoPipeline(tiny_pipe.components, backend="onnxruntime", engines=engines)


def _close(eager, ort, tol):
    assert [b["decision"] for b in eager.stats["blocks"]] == [b["decision"] for b in ort.stats["blocks"]]
    assert (eager.latents - ort.latents).abs().max() <= tol["latents"]
    assert np.abs(eager.frames.astype(int) - ort.frames.astype(int)).max() <= tol["frames"]
    for a, b in zip(eager.stats["blocks"], ort.stats["blocks"]):
        assert (a["score"] is None) == (b["score"] is None)
        if a["score"] is not None:
            assert a["score"] == pytest.approx(b["score"], abs=tol["scores"])


def test_engine_folder_holds_every_engine(engines):
    names = sorted(m.parent.name.rsplit("-", 1)[0] for m in engines.glob("*/manifest.json"))
    assert names == ["drafter_dit_3f", "drafter_dit_3f_cached", "reward_12f", "reward_9f", "target_dit_3f",
                     "target_dit_3f_cached", "vae_decode"]
    m = json.loads(next(engines.glob("target_dit_3f_cached-*/manifest.json")).read_text())
    assert m["key"]["artifact"] == "onnx" and m["key"]["precision"] == "fp32"
    shapes = {n: s for n, s, _ in m["key"]["shapes"]}
    assert shapes["cache_index"] == ["visible_tokens"] and shapes["kv_0"] == [2, 1, 4, "cache_tokens", 16]


@pytest.mark.parametrize("mode", ["target", "sdvg"])
def test_video_through_onnxruntime_equals_eager(tiny_pipe, ort_pipe, mode):
    eager = tiny_pipe("a red fox", mode=mode, **KW)
    ort = ort_pipe("a red fox", mode=mode, **KW)
    assert ort.stats["options"]["backend"] == "onnxruntime"
    _close(eager, ort, ORT_TOLERANCE[tiny_pipe.preset.precision])


def test_recompute_context_through_onnxruntime(tiny_pipe, ort_pipe):
    """The engine set covers a recompute target (context forward at 3 frames, denoising over 3 visible
    frames in a 6-frame cache): the video equals eager."""
    eager = tiny_pipe("a red fox", mode="target", target_context="recompute", **KW)
    ort = ort_pipe("a red fox", mode="target", target_context="recompute", **KW)
    assert ort.stats["result"]["target_forwards"] == eager.stats["result"]["target_forwards"] == 5 * 3 + 2  # 2 context forwards
    _close(eager, ort, ORT_TOLERANCE["fp32"])


def test_static_step_through_onnxruntime_writes_in_place(tiny_pipe, engines):
    from test_engine_modules import assert_in_place_step

    c = tiny_pipe.components
    runners = StageRunners(c, "onnxruntime", engines)
    dit = c.target
    text = dit.encode_text(c.text_encoder.encode("a fox"))
    cache = KVCacheSpec.for_dit(dit.config, 16, 24).allocate(dit.dtype, "cpu")
    eager_cache = KVCacheSpec.for_dit(dit.config, 16, 24).allocate(dit.dtype, "cpu")
    runners.dit_forward("target", dit, torch.zeros(1, 16, 3, 8, 8), torch.zeros(1, 3), text, 0, cache)  # text stacked
    cache.rollback(0)
    g = torch.Generator().manual_seed(3)
    for b in range(3):
        x, t = torch.randn(1, 16, 3, 8, 8, generator=g), torch.full((1, 3), 500.0)
        out = {}
        assert_in_place_step(lambda: out.update(y=runners.dit_forward("target", dit, x, t, text, None, cache)), cache)
        want = dit(x, t, text, cache=eager_cache)
        assert (out["y"] - want).abs().max() < 1e-5
        assert (cache.buffer - eager_cache.buffer).abs().max() < 1e-5
        cache.commit()
        eager_cache.commit()


REFUSED = dict(mode="target", num_blocks=1, scheduler="reference")  # the refusal comes from the first DiT call


def _foreign(pipe, match):
    with pytest.raises((StaleEngineError, CorruptEngineError)) as err:
        pipe("a red fox", **REFUSED)
    msg = str(err.value)
    assert all(m in msg for m in match), msg
    return msg


def test_tampered_folder_is_refused(tiny_pipe, engines, tmp_path):
    folder = tmp_path / "engines"
    shutil.copytree(engines, folder)
    model = next(folder.glob("target_dit_3f-*/model.onnx"))
    data = model.read_bytes()
    model.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    pipe = SpeculativeVideoPipeline(tiny_pipe.components, backend="onnxruntime", engines=folder)
    with pytest.raises(CorruptEngineError, match="SHA-256"):
        pipe("a red fox", **REFUSED)
    model.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptEngineError, match="truncated"):
        SpeculativeVideoPipeline(tiny_pipe.components, backend="onnxruntime", engines=folder)(
            "a red fox", **REFUSED)


def test_folder_for_other_weights_or_precision_is_refused(engines):
    other = SpeculativeVideoPipeline.from_preset("tiny", seed=1, backend="onnxruntime", engines=engines)
    msg = _foreign(other, ["weights_hash", "--weights-seed 1", "--format onnx", f"--out {engines}"])
    assert "--precision fp32" in msg
    half = SpeculativeVideoPipeline.from_preset("tiny", torch_dtype=torch.float16, backend="onnxruntime",
                                                engines=engines)
    _foreign(half, ["precision: built for 'fp32', needed 'fp16'", "--precision fp16"])


def test_missing_engine_names_the_build_flags(tiny_pipe, engines):
    runners = StageRunners(tiny_pipe.components, "onnxruntime", engines)
    with pytest.raises(MissingEngineError, match="--kv-cache-frames 6"):  # a 6-frame recompute context forward
        runners._dit_engine("target", 6, False)
    with pytest.raises(MissingEngineError) as e:
        runners._reward_engine(5)
    assert "'reward_5f'" in str(e.value)
    with pytest.raises(ValueError) as e:
        StageRunners(tiny_pipe.components, "onnxruntime")
    assert all(s in str(e.value) for s in ("engines=", "--format onnx")), e.value


def test_cli_generate_with_onnxruntime(engines, tmp_path):
    from sdvg import cli

    out = tmp_path / "v.mp4"
    assert cli.main(["generate", "--prompt", "a red fox", "--quiet", "--num-blocks", "1", "--backend", "onnxruntime",
                     "--engines", str(engines), "--out", str(out)]) == 0
    assert out.is_file() and json.loads(out.with_suffix(".json").read_text())["options"]["num_blocks"] == 1


# ------------------------------------------------------------------ checkpoints
def test_engines_built_from_checkpoints_load_for_the_same_checkpoints_only(tmp_path):
    """build_engines takes generate's checkpoint flags: an engine built from checkpoints loads for the
    pipeline built from them and is refused for other weights, with a rebuild command that works."""
    from build_engines.__main__ import main as build
    from conftest import write_real_checkpoints

    paths = {}
    for seed in (0, 1):
        folder = tmp_path / f"ckpt{seed}"
        folder.mkdir()
        comps = SpeculativeVideoPipeline.from_preset("tiny", seed=seed).components
        paths[seed] = write_real_checkpoints(comps, folder)
    flags = {s: [a for role, p in paths[s].items() for a in (f"--{role.replace('_', '-')}", str(p))] for s in paths}
    out = tmp_path / "engines"
    assert build(["--preset", "tiny", *flags[0], "--format", "onnx", "--stages", "reward", "--out", str(out)]) == 0
    # --stages builds the engine families asked for and no others
    assert sorted(m.parent.name.rsplit("-", 1)[0] for m in out.glob("*/manifest.json")) == ["reward_12f", "reward_9f"]

    def reward_engine(seed):
        pipe = SpeculativeVideoPipeline.from_pretrained("tiny", **paths[seed], drafter_device="cpu",
                                                        backend="onnxruntime", engines=out)
        return pipe.runners()._reward_engine(12)

    assert reward_engine(0) is not None
    with pytest.raises(StaleEngineError, match="weights_hash") as err:
        reward_engine(1)
    cmd = str(err.value).split("rebuild with: ", 1)[1]
    assert all(f in shlex.split(cmd) for f in flags[1])
    argv = shlex.split(cmd)
    assert argv[:3] == ["python", "-m", "build_engines"]
    assert build(argv[3:] + ["--stages", "reward"]) == 0  # the command, restricted to the engine family under test
    assert reward_engine(1) is not None
