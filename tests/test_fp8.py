"""FP8 DiT linears (the `quantization` run option, sdvg/models/fp8.py): the quantization rule against torchao's
own tensor (bitwise), both implementations against the plain reference (`IMPL_TOLERANCE`), FP8 against the
model dtype (`FP8_TOLERANCE`), the copy that shares every other tensor, the refusals before anything loads,
the memory plan, and whole tiny videos through every entry point (slow)."""
import copy
import json
import threading

import weakref

import pytest
import torch
import torch.nn.functional as F

from sdvg.config import get_preset
from sdvg.models import fp8
from sdvg.options import GenerationOptions, OptionError

PROMPT = "a red fox"


@pytest.fixture(scope="module")
def tiny_dits():
    """The tiny preset's drafter and target DiTs, random weights, fp32 and bf16."""
    from sdvg.models.components import build_random

    out = {}
    for precision in ("fp32", "bf16"):
        c = build_random(get_preset("tiny").replace(precision=precision), need_reward=False)
        out[precision] = (c, c.text_encoder.encode(PROMPT))
    return out


@pytest.fixture
def impl(request, monkeypatch):
    """Force an FP8 implementation for the test (the per-device choice is reset after it)."""
    name = request.param
    if name == "torchao":
        pytest.importorskip("torchao")
    why = fp8.impl_error(name, "cpu", torch.float32)
    if why:  # e.g. torch 2.11's CPU _scaled_mm takes per-tensor scales only
        pytest.skip(f"{name} does not run on this torch's CPU: {why[:200]}")
    monkeypatch.setattr(fp8, "_IMPL_BY_DEVICE", {})
    monkeypatch.setattr(fp8, "_COPIES", weakref.WeakKeyDictionary())  # no copy made under another impl is reused
    monkeypatch.setattr(fp8, "choose_impl", lambda device, dtype: (name, None if name == "torchao" else "forced"))
    return name


def _rows(dtype, seed=0):
    """Rows of every kind the rule must handle: Gaussian, large, tiny, an all-zero row, a single spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, 64, generator=g)
    x[1] *= 3e4
    x[2] *= 1e-6
    x[3] = 0.0
    x[4] = 0.0
    x[4, :, 7] = -2.5
    return x.to(dtype)


# ---------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rule_is_torchaos_float8_tensor_bitwise(dtype):
    pytest.importorskip("torchao")
    from torchao.quantization import Float8Tensor, PerRow

    for x in (_rows(dtype), _rows(dtype, 1)[0]):  # activations [..., K] and a weight [N, K]
        q, scale = fp8.quantize_rows(x)
        t = Float8Tensor.from_hp(x, float8_dtype=fp8.FP8_DTYPE, granularity=PerRow(), hp_value_lb=fp8.AMAX_EPS)
        assert torch.equal(q.view(torch.uint8), t.qdata.view(torch.uint8))
        assert torch.equal(scale, t.scale) and scale.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rule_maps_each_rows_amax_to_448_and_rounds_to_e4m3(dtype):
    x = _rows(dtype)
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (*x.shape[:-1], 1)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all() and (scale > 0).all()
    nonzero = x.abs().amax(-1) > 0
    assert torch.all(q.float().abs().amax(-1)[nonzero] == fp8.FP8_MAX)  # scale = amax / 448 (up to its rounding)
    eps_scale = (torch.tensor(fp8.AMAX_EPS, dtype=dtype) / 448).float()
    assert torch.all(q.float()[3] == 0) and torch.all(scale[3] == eps_scale)  # a zero row: a finite scale, q = 0
    back = fp8.dequantize_rows(q, scale)
    normal = q.float().abs() >= 2.0 ** -6  # e4m3's normal range: 3 mantissa bits, half an ulp is 2^-4 relative
    err = (back - x.float()).abs()
    assert torch.all(err[normal] <= 2.0 ** -4 * back.abs()[normal] * 1.0001)
    assert torch.all(err[~normal] <= 2.0 ** -10 * scale.expand_as(x)[~normal])  # subnormals: a fixed step of 2^-9


# ---------------------------------------------------------------------------- the implementations
def _linear(dtype, n=48, k=64, bias=True, seed=2):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).requires_grad_(False)
    lin.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
    if bias:
        lin.bias.copy_(torch.randn(n, generator=g))
    return lin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_both_implementations_match_the_reference(dtype, bias):
    why = fp8.impl_error("scaled_mm", "cpu", dtype)
    if why:
        pytest.skip(f"torch._scaled_mm does not run row-wise FP8 on this torch's CPU: {why[:200]}")
    lin = _linear(dtype, bias=bias)
    x = _rows(dtype)[[0, 4, 5]]  # [3, 5, 64], the spike row included
    ref = fp8.reference_linear(x, *fp8.quantize_rows(lin.weight), lin.bias)
    direct = fp8.ScaledMMLinear.from_linear(lin)(x)
    assert direct.dtype == dtype and direct.shape == (3, 5, 48)
    assert fp8.relative_error(direct, ref) <= fp8.IMPL_TOLERANCE[dtype]
    try:
        import torchao  # noqa: F401
    except ImportError:
        return
    via_torchao = F.linear(x, fp8.torchao_weight(lin.weight), lin.bias)
    assert fp8.relative_error(via_torchao, ref) <= fp8.IMPL_TOLERANCE[dtype]
    assert torch.equal(via_torchao, direct)  # on the CPU both make the same _scaled_mm call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_against_the_model_dtype_within_the_table(dtype):
    lin = _linear(dtype, n=256, k=512)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    chosen = {"reference": fp8.ReferenceLinear}.get(fp8.choose_impl("cpu", dtype)[0], fp8.ScaledMMLinear)
    err = fp8.relative_error(chosen.from_linear(lin)(x), lin(x))
    assert 1e-3 < err <= fp8.FP8_TOLERANCE["linear"], err  # quantized (not the model's own arithmetic), within 5 %


# ---------------------------------------------------------------------------- the DiT
def _expected_names(dit) -> set:
    return {f"blocks.{i}.{p}" for i in range(len(dit.model.blocks)) for p in fp8.QUANTIZED_LINEARS}


@pytest.mark.parametrize("impl", fp8.IMPLS, indirect=True)
def test_copy_shares_every_tensor_but_the_quantized_weights(tiny_dits, impl):
    comps, emb = tiny_dits["fp32"]
    dit = comps.target
    text = dit.encode_text(emb)
    x, t = torch.randn(1, 16, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.full((1, 3), 500.0)
    before = dit(x, t, text)
    dup = fp8.quantized_copy(dit)
    assert fp8.fp8_state(dup).impl == impl and not fp8.fp8_state(dup).in_place and fp8.fp8_state(dit) is None
    original = {id(p) for p in (*dit.parameters(), *dit.buffers())}
    own = {name.removeprefix("model.").rsplit(".", 1)[0] for name, p in (*dup.named_parameters(),
                                                                         *dup.named_buffers())
           if id(p) not in original}
    assert own == _expected_names(dit)  # nothing else was copied
    dup_modules = dict(dup.model.named_modules())
    for name, _, _ in fp8.quantized_linears(dup.model):
        plain = dict(dit.model.named_modules())[name]
        assert dup_modules[name].bias is plain.bias and isinstance(plain.weight, torch.nn.Parameter)
        assert plain.weight.dtype == torch.float32  # the original keeps its model-dtype weights
    assert dup.angle_table is dit.angle_table
    assert torch.equal(dit(x, t, text), before)  # the original computes what it did
    assert not torch.equal(dup(x, t, dup.encode_text(emb)), before)


@pytest.mark.parametrize("impl", fp8.IMPLS, indirect=True)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cached_forward_within_tolerance_and_in_place_equals_the_copy(tiny_dits, impl, precision):
    comps, emb = tiny_dits[precision]
    p = comps.preset
    lh, lw = p.video.latent_hw(p.vae)
    for role in ("drafter", "target"):
        dit = getattr(comps, role)
        dup = fp8.quantized_copy(dit)
        err = fp8.cached_forward_error(dit, dup, emb, p.video.frames_per_block, lh, lw)
        assert 0 < err <= fp8.FP8_TOLERANCE["forward"], (role, err)
    again = copy.deepcopy(comps.target)  # the same weights, quantized in place
    fp8.quantize_in_place(again)
    state = fp8.fp8_state(again)
    assert state.in_place and state.impl == impl
    assert fp8.cached_forward_error(again, fp8.quantized_copy(comps.target), emb, 3, lh, lw) == 0.0


@pytest.mark.parametrize("impl", fp8.IMPLS, indirect=True)
def test_resident_bytes_of_an_in_place_dit_are_its_fp8_weights_and_the_rest(impl):
    from sdvg.models.components import build_random
    from sdvg.models.memory import fp8_weights_item, plan_memory, resident_items

    preset = get_preset("tiny").replace(precision="bf16")
    comps = build_random(preset, need_reward=False)
    dit = comps.target
    fp8_names = {f"model.{n}.weight" for n in _expected_names(dit)}
    rest = sum(p.numel() * p.element_size() for n, p in dit.named_parameters() if n not in fp8_names)
    rest += sum(b.numel() * b.element_size() for b in dit.buffers())
    weights = sum(dict(dit.named_parameters())[n].numel() for n in fp8_names)
    rows = sum(dict(dit.named_parameters())[n].shape[0] for n in fp8_names)
    fp8.quantize_in_place(dit)
    (item,) = resident_items({"target": dit})
    assert item.nbytes == rest + weights * 1 + rows * 4  # e4m3 bytes, fp32 row scales (torchao's wrapper says bf16)
    assert fp8.tensor_bytes(fp8.fp8_tensors(dit)) == weights + 4 * rows
    assert fp8_weights_item(preset.target, "cpu", "x").item.nbytes == weights + 4 * rows  # the plan's arithmetic
    contexts = {"target": GenerationOptions().resolved(preset).role_context("target")}
    planned = {it.what: it.nbytes for it in plan_memory(preset, contexts, 1, "cpu", "cpu", "cpu", fp8_roles=("target",))
               if "weights" in it.what}
    assert planned["target FP8 weights"] == weights + 4 * rows
    assert planned["target weights"] == (preset.target.num_params() - weights) * 2


def test_sdvg_memory_reports_the_fp8_weights(capsys):
    from sdvg import cli

    assert cli.main(["memory", "--preset", "wan2.1", "--quantization", "fp8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    items = {it["what"]: it for it in plan["items"]}
    # the 14B target: 40 blocks of 4 + 4 [5120, 5120] attention linears and the FFN's [13824, 5120] and [5120, 13824]
    weights, rows = 40 * (8 * 5120 * 5120 + 2 * 5120 * 13824), 40 * (8 * 5120 + 13824 + 5120)
    assert items["target FP8 weights"]["gib"] * 2**30 == pytest.approx(weights + 4 * rows, abs=1)
    assert plan["quantization"] == "fp8" and "drafter FP8 weights" in items
    assert cli.main(["memory", "--preset", "wan2.1", "--quantization", "fp8", "--backend", "tensorrt"]) == 2
    assert "only the eager and compile backends run" in capsys.readouterr().err


def test_one_copy_per_dit_across_threads_dropped_when_stale():
    from sdvg.models.components import build_random

    dit = build_random(get_preset("tiny"), need_reward=False).drafter
    got, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        got.append(fp8.role_dit(dit, "drafter", True))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({id(d) for d in got}) == 1 and fp8.kept_copy(dit) is got[0] and got[0] is not dit
    assert fp8.role_dit(dit, "drafter", False) is dit
    dit.set_precision("bf16")  # a cast: the copy was made for fp32
    assert fp8.kept_copy(dit) is None
    assert fp8.role_dit(dit, "drafter", True).dtype == torch.bfloat16


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes,match", [
    (dict(quantization="int8"), "unknown quantization 'int8'; choose one of none, fp8, fp8-target, fp8-drafter"),
    (dict(quantization="fp8", backend="tensorrt"), "only the eager and compile backends run"),
    (dict(quantization="fp8-target", backend="onnxruntime"), "quantization 'fp8-target' runs"),
    (dict(quantization="fp8-drafter", backend="torch-tensorrt"), "drop --quantization"),
])
def test_bad_quantization_is_refused_by_name(changes, match):
    with pytest.raises(OptionError, match=match):
        GenerationOptions(**changes)


def test_fp8_runs_with_compile_and_cuda_graphs_and_resolves_the_pipelines_default():
    GenerationOptions(quantization="fp8", backend="compile")
    GenerationOptions(quantization="fp8", cuda_graphs=True, backend="eager")
    tiny = get_preset("tiny")
    assert GenerationOptions().resolved(tiny).quantization == "none"
    assert GenerationOptions().resolved(tiny, quantization="fp8-target").fp8_roles() == ("target",)
    assert GenerationOptions(quantization="none").resolved(tiny, quantization="fp8").fp8_roles() == ()
    with pytest.raises(OptionError, match="not resolved"):
        GenerationOptions().fp8_roles()
    with pytest.raises(OptionError) as e:
        GenerationOptions(quantization="fp8").resolved(tiny, backend="tensorrt")
    assert "tensorrt" in str(e.value)


@pytest.mark.parametrize("device,capability,kwargs,match", [
    ("cuda:0", (8, 6), {}, r"cuda:0 has compute capability 8\.6, and FP8 matmuls need 8\.9"),
    ("cuda:0", (9, 0), {}, "runs a bf16 model .* torch.float32; load it with torch_dtype=torch.bfloat16"),
    ("mps", None, {}, "FP8 runs on CUDA .* or on the CPU, not on mps"),
    ("cpu", None, {"torch_dtype": torch.float16}, "runs a bf16 .* model, this one is torch.float16"),
])
def test_fp8_where_it_cannot_run_is_refused_before_anything_loads(monkeypatch, device, capability, kwargs, match):
    import sdvg.pipeline
    from sdvg import SpeculativeVideoPipeline

    def never(*args, **kw):
        raise AssertionError("loaded a model before refusing")

    monkeypatch.setattr(sdvg.pipeline, "build_random", never)
    monkeypatch.setattr(sdvg.pipeline, "load_pretrained", never)
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    with pytest.raises(fp8.FP8Error, match=match):
        SpeculativeVideoPipeline.from_preset("tiny", device=device, quantization="fp8", **kwargs)
    with pytest.raises(fp8.FP8Error, match=match):
        SpeculativeVideoPipeline.from_pretrained("tiny", drafter="d.pt", target="t.pt", vae="v", text_encoder="te",
                                                 drafter_device=device, quantization="fp8-target", **kwargs)
    with pytest.raises(OptionError) as e:
        SpeculativeVideoPipeline.from_preset("tiny", quantization="fp4")
    assert "'fp4'" in str(e.value)
    if capability == (8, 6):  # an Ada or Hopper card passes
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
        assert fp8.fp8_conflict(device, torch.bfloat16) is None


def test_cli_refuses_fp8_with_an_engine_backend_before_loading(tmp_path, capsys):
    from sdvg import cli

    def never(args):
        raise AssertionError("loaded a model before refusing")

    rc = cli.main(["generate", "--prompt", "x", "--quantization", "fp8", "--backend", "onnxruntime", "--engines",
                   str(tmp_path), "--out", str(tmp_path / "a.mp4")], load_pipeline=never)
    assert rc == 2 and "quantization 'fp8' runs the DiTs' linears in FP8" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fp8_target_pipe():
    """The tiny preset loaded with quantization='fp8-target' (the target quantized in place)."""
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny", quantization="fp8-target")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_a_pipeline_loaded_in_fp8_refuses_the_weights_it_dropped(fp8_target_pipe):
    pipe = fp8_target_pipe
    state = fp8.fp8_state(pipe.target)
    assert pipe.default_quantization == "fp8-target" and state.in_place and fp8.fp8_state(pipe.drafter) is None
    assert pipe.resolve(GenerationOptions()).quantization == "fp8-target"
    assert pipe.resolve(GenerationOptions(quantization="fp8")).fp8_roles() == ("drafter", "target")
    for asked in ("none", "fp8-drafter"):
        with pytest.raises(fp8.FP8Error) as e:
            pipe.resolve(GenerationOptions(quantization=asked))
        assert all(s in str(e.value) for s in (f"quantization '{asked}'", "dropped", "quantization='fp8'",
                                               "'fp8-target'", "without quantization=")), e.value
        with pytest.raises(fp8.FP8Error, match="dropped"):
            pipe(PROMPT, num_blocks=1, quantization=asked)
    assert pipe.resolve(GenerationOptions(quantization="none", mode="draft")).fp8_roles() == ()  # the target is not run
    with pytest.raises(fp8.FP8Error) as e:
        pipe.to(torch.bfloat16)
    assert all(s in str(e.value) for s in ("pipe.to(torch.bfloat16)", "quantized in place")), e.value
    assert pipe.dtype == torch.float32 and fp8.fp8_state(pipe.target) is state


# ---------------------------------------------------------------------------- whole videos (slow)
@pytest.mark.slow
@pytest.mark.parametrize("impl", fp8.IMPLS, indirect=True)
def test_fp8_videos_through_every_entry_point(impl):
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    pipe.set_progress_bar_config(disable=True)
    plain = pipe(PROMPT, num_blocks=3, seed=1)
    out = pipe(PROMPT, num_blocks=3, seed=1, quantization="fp8")
    assert out.stats["options"]["quantization"] == "fp8"
    assert out.stats["run"]["fp8_impl"] == {"drafter": impl, "target": impl}
    assert plain.stats["options"]["quantization"] == "none" and plain.stats["run"]["fp8_impl"] == {}
    err = fp8.relative_error(out.latents, plain.latents)
    assert 0 < err <= fp8.FP8_TOLERANCE["forward"], err
    ref = pipe(PROMPT, num_blocks=3, seed=1, quantization="fp8", scheduler="reference")
    assert torch.equal(ref.latents, out.latents)  # the native scheduler == the reference loop, in FP8 too
    blocks = list(pipe.stream(PROMPT, num_blocks=3, seed=1, quantization="fp8"))
    assert torch.equal(torch.cat([b.latents for b in blocks], dim=2), out.latents)
    session = pipe.session(PROMPT, num_blocks=3, seed=1, quantization="fp8-target", scheduler="reference")
    lat = torch.cat([b.latents for b in session], dim=2)
    assert session.stats["run"]["fp8_impl"] == {"target": impl}
    assert torch.equal(lat, pipe(PROMPT, num_blocks=3, seed=1, quantization="fp8-target").latents)
    copies = [fp8.kept_copy(pipe.drafter), fp8.kept_copy(pipe.target)]
    assert all(c is not None for c in copies)  # quantized once, kept for the later calls
    pipe(PROMPT, num_blocks=1, quantization="fp8")
    assert [fp8.kept_copy(pipe.drafter), fp8.kept_copy(pipe.target)] == copies


@pytest.mark.slow
def test_cuda_graphs_in_fp8_replay_bitwise_and_a_loaded_pipeline_equals_the_copy():
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, num_blocks=3, seed=2, quantization="fp8")
    graphed = pipe(PROMPT, num_blocks=3, seed=2, quantization="fp8", cuda_graphs=True)
    assert torch.equal(graphed.latents, out.latents) and pipe.runners().graphs.replays > 0
    loaded = SpeculativeVideoPipeline.from_preset("tiny", quantization="fp8")
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded(PROMPT, num_blocks=3, seed=2).latents, out.latents)
