"""The compile backend (sdvg/generation/compile.py): each DiT block's regions compiled once for every layer,
never recompiled as the KV cache grows; videos within COMPILE_TOLERANCE of eager; its settings refused
before any model loads."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from sdvg import SpeculativeVideoPipeline
from sdvg.config import DiTConfig
from sdvg.generation.compile import CompileSettings, CompileSettingsError
from sdvg.models.dit import CausalWanDiT
from sdvg.models.dit_block import BlockRegions, after_attention, before_attention
from sdvg.models.kv_cache import KVCacheSpec

PROMPT = "a red fox running through fresh snow"
TPF = 16


def _counted_regions():
    counter = CompileCounterWithBackend("aot_eager")
    regions = BlockRegions(*(torch.compile(f, backend=counter, dynamic=False, fullgraph=True)
                             for f in (before_attention, after_attention)))
    return regions, counter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regions_compile_once_for_every_layer_and_never_as_the_cache_grows(dtype):
    """fullgraph: no graph break in either region; two graphs (one per region) serve every layer of a DiT
    and every block, however many frames the cache holds; the compiled forward equals eager (aot_eager
    traces without changing the arithmetic)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dit = CausalWanDiT(DiTConfig(dim=48, ffn_dim=96, num_heads=4, num_layers=3, text_dim=32)).eval()
    dit.set_precision({torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    text = dit.encode_text(torch.randn(1, 5, 32))
    regions, counter = _counted_regions()
    spec = KVCacheSpec.for_dit(dit.config, TPF, max_frames=12)
    compiled_cache, eager_cache = spec.allocate(dtype, "cpu"), spec.allocate(dtype, "cpu")
    for block in range(4):  # 0, 3, 6, 9 frames visible
        x, t = torch.randn(1, 16, 3, 8, 8), torch.full((1, 3), 500.0)
        got = dit(x, t, text, cache=compiled_cache, regions=regions)
        want = dit(x, t, text, cache=eager_cache)
        compiled_cache.commit()
        eager_cache.commit()
        assert torch.equal(got, want), block
        assert counter.frame_count == 2, (block, counter.frame_count)


def test_compile_settings_are_refused_by_name_before_any_model_loads(monkeypatch, tmp_path):
    import sdvg.pipeline as pipeline

    def no_build(*a, **k):
        raise AssertionError("a model was built before the compile settings were checked")

    monkeypatch.setattr(pipeline, "build_random", no_build)
    with pytest.raises(CompileSettingsError) as e:
        SpeculativeVideoPipeline.from_preset("tiny", backend="compile", compile_mode="fastest")
    assert all(s in str(e.value) for s in ("'fastest'", "max-autotune-no-cudagraphs")), e.value
    with pytest.raises(CompileSettingsError) as e:
        SpeculativeVideoPipeline.from_preset("tiny", backend="compile", compile_mode="reduce-overhead")
    assert "cuda_graphs=True" in str(e.value)
    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    with pytest.raises(CompileSettingsError) as e:
        SpeculativeVideoPipeline.from_preset("tiny", backend="compile", compile_cache=str(a_file))
    assert all(s in str(e.value) for s in ("not a folder", "--compile-cache")), e.value
    with pytest.raises(CompileSettingsError) as e:
        SpeculativeVideoPipeline.from_preset("tiny", backend="compile", compile_cache=str(a_file / "below"))
    assert all(s in str(e.value) for s in ("cannot be written", "--compile-cache")), e.value
    with pytest.raises(CompileSettingsError, match="unknown compiler"):
        CompileSettings(compiler="tvm")
    made = CompileSettings(cache_dir=str(tmp_path / "new" / "cache"))  # a missing folder is made
    assert (tmp_path / "new" / "cache").is_dir() and made.cache_dir == str((tmp_path / "new" / "cache").resolve())


@pytest.mark.slow  # compiles every region of both DiTs, the VAE and the reward model (~30 s on 2 cores)
def test_compile_backend_video_through_the_eager_loop(tiny_pipe):
    """backend compile (a tracing compiler, so the DiTs' arithmetic is eager's): the latents bitwise eager's,
    the frames within the fast VAE's tolerance (its channels-last decode); the statistics say what compiling
    cost, and a second video compiles nothing. A start frame runs under compile (the eager loop's shapes)."""
    from sdvg.generation.fast_vae import FAST_VAE_TOLERANCE

    torch._dynamo.reset()
    pipe = SpeculativeVideoPipeline(tiny_pipe.components, compile_settings=CompileSettings(compiler="aot_eager"))
    kw = dict(num_blocks=3, seed=1, router="pattern", pattern="0101")
    eager = pipe(PROMPT, **kw)
    first = pipe(PROMPT, backend="compile", **kw)
    second = pipe(PROMPT, backend="compile", **kw)
    assert torch.equal(first.latents, eager.latents) and torch.equal(second.latents, eager.latents)
    # frames are 8-bit levels: a decode within FAST_VAE_TOLERANCE moves a pixel by at most one level
    assert FAST_VAE_TOLERANCE[torch.float32] < 1 / 255 and abs(first.frames - eager.frames).max() <= 1 / 255 + 1e-6
    c1, c2 = first.stats["result"]["compile"], second.stats["result"]["compile"]
    assert c1["graphs"] >= 4 and c1["compile_s"] > 0 and c1["compiler"] == "aot_eager", c1
    # by part: both regions (each once per DiT), the VAE's steady frame, the reward model per frame count
    assert {"dit.before_attention", "dit.after_attention", "vae", "reward"} <= set(c1["by_part"]), c1["by_part"]
    assert c1["by_part"]["dit.before_attention"]["graphs"] == 2 and c1["by_part"]["vae"]["seconds"] > 0
    assert c2["graphs"] == 0 and c2["compile_s"] == 0 and c2["by_part"] == {}, c2
    assert eager.stats["result"]["compile"] is None and first.stats["options"]["backend"] == "compile"
    import numpy as np

    image = (np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8)
    a = pipe(PROMPT, num_blocks=2, mode="target", start_frame=image)
    b = pipe(PROMPT, num_blocks=2, mode="target", start_frame=image, backend="compile")
    assert torch.equal(a.latents, b.latents)


def test_cli_refuses_a_bad_compile_cache_before_loading(tmp_path, capsys, monkeypatch):
    """`sdvg generate --backend compile --compile-cache FILE`: refused by name, nothing built or written."""
    import sdvg.pipeline as pipeline
    from sdvg import cli

    monkeypatch.setattr(pipeline, "build_random", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a model was built before the compile settings were checked")))
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    out = tmp_path / "v.mp4"
    code = cli.main(["generate", "--prompt", PROMPT, "--backend", "compile", "--compile-cache", str(a_file),
                     "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code != 0 and "is a file, not a folder" in err and "--compile-cache" in err, err
    assert not out.exists()
    with pytest.raises(SystemExit) as bad:  # argparse: the mode's choices
        cli.main(["generate", "--prompt", PROMPT, "--backend", "compile", "--compile-mode", "reduce-overhead"])
    assert bad.value.code == 2 and "max-autotune-no-cudagraphs" in capsys.readouterr().err
