"""Weights that are not floating or not finite are refused as they are read, in every format, by the
file's key name; NaN/inf in a stage output is an error naming the stage and the block, except for a
draft, which is rejected (with a warning) and replaced by the target's block, in both schedulers."""
import math
import warnings
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdvg.config import get_preset
from sdvg.generation.guard import NonFiniteDraftWarning, NonFiniteError
from sdvg.generation.native import generate_blocks_native
from sdvg.generation.reference import generate_blocks
from sdvg.models.checkpoints import (CheckpointError, check_dit_checkpoint, check_weights, load_dit,
                                     nonfinite_counts, save_dit)
from sdvg.models.dit import CausalWanDiT
from sdvg.options import GenerationOptions

from conftest import randomize, write_real_checkpoints

FIX = "re-download / re-export the checkpoint"
DIT_FORMATS = [  # format, file name, the file's name of the diffusers key `blocks.0.attn1.to_q.weight`
    ("diffusers", "dit_folder", "blocks.0.attn1.to_q.weight"),
    ("original", "wan.safetensors", "blocks.0.self_attn.q.weight"),
    ("krea", "krea.safetensors", "model.blocks.0.self_attn.q.weight"),
    ("self-forcing", "sf.pt", "model.blocks.0.self_attn.q.weight"),
]


def _poison(path, key, how="nan", count=1):
    """Rewrite one tensor of a real checkpoint file in place (the file's own structure kept):
    `count` NaN (or inf) values, or the tensor cast to int8."""
    def bad(t):
        if how == "int8":
            return t.to(torch.int8)
        t = t.clone()
        t.view(-1)[:count] = math.nan if how == "nan" else math.inf
        return t

    path = str(path)
    if path.endswith(".safetensors"):
        state = load_file(path)
        state[key] = bad(state[key])
        save_file(state, path)
    else:
        obj = torch.load(path, weights_only=True)
        for d in (obj, *[v for v in obj.values() if isinstance(v, dict)]):
            if key in d:
                d[key] = bad(d[key])
        torch.save(obj, path)


@pytest.fixture(scope="module")
def source():
    return randomize(CausalWanDiT(get_preset("tiny").drafter).eval(), std=0.1, seed=3)


def _file_of(path, fmt):
    return path / "diffusion_pytorch_model.safetensors" if fmt == "diffusers" else path


@pytest.mark.parametrize("fmt,name,key", DIT_FORMATS)
def test_dit_nan_is_refused_by_the_files_key_before_any_model_exists(tmp_path, source, fmt, name, key, monkeypatch):
    path = tmp_path / name
    save_dit(source, path, fmt)
    _poison(_file_of(path, fmt), key, "nan", count=12)
    monkeypatch.setattr(CausalWanDiT, "__init__", lambda *a, **k: pytest.fail("a model was allocated"))
    with pytest.raises(CheckpointError) as err:
        check_dit_checkpoint(path, source.config)
    msg = str(err.value)
    assert str(_file_of(path, fmt)) in msg and repr(key) in msg and FIX in msg
    assert "1 unusable tensor(s)" in msg and "non-finite values (12 NaN, 0 inf)" in msg


@pytest.mark.parametrize("fmt,name,key", DIT_FORMATS)
def test_dit_integer_weights_are_refused(tmp_path, source, fmt, name, key):
    path = tmp_path / name
    save_dit(source, path, fmt)
    _poison(_file_of(path, fmt), key, "int8")
    with pytest.raises(CheckpointError, match=rf"{key!r}: dtype torch.int8, not a floating dtype.*{FIX}"):
        load_dit(CausalWanDiT(source.config), path)


def test_many_bad_tensors_name_the_first_and_count_the_rest(tmp_path, source):
    from sdvg.models.checkpoints import diffusers_to_original

    state = {k: v.contiguous() for k, v in diffusers_to_original(source.model.state_dict()).items()}
    bad = sorted(k for k in state if k.endswith(".weight"))[:5]
    for i, k in enumerate(bad):
        state[k] = state[k].clone()
        state[k].view(-1)[0] = math.inf if i % 2 else math.nan
    state[bad[0]].view(-1)[1] = -math.inf
    save_file(state, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_dit(CausalWanDiT(source.config), tmp_path / "w.safetensors")
    msg = str(err.value)
    assert "5 unusable tensor(s)" in msg and "and 2 more" in msg
    assert f"{bad[0]!r}: non-finite values (1 NaN, 1 inf)" in msg and f"{bad[1]!r}: non-finite values (0 NaN, 1 inf)" in msg


def test_vae_nan_refused_in_both_formats(tmp_path, tiny_preset):
    from sdvg.models.vae import build_vae, load_vae_weights

    vae = randomize(build_vae(tiny_preset.vae), std=0.05, seed=1)
    vae.save_pretrained(tmp_path / "vae")
    f = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    key = sorted(load_file(str(f)))[0]
    _poison(f, key, "inf", count=3)
    with pytest.raises(CheckpointError, match=rf"{key!r}: non-finite values \(0 NaN, 3 inf\).*{FIX}"):
        load_vae_weights(build_vae(tiny_preset.vae), tmp_path / "vae")
    torch.save({k: v.to(torch.int8) if k == key else v for k, v in vae.state_dict().items()}, tmp_path / "vae.pth")
    with pytest.raises(CheckpointError, match=rf"vae.pth: 1 unusable.*{key!r}: dtype torch.int8"):
        load_vae_weights(build_vae(tiny_preset.vae), tmp_path / "vae.pth")


def test_image_reward_nan_refused_by_the_packages_key(tmp_path, tiny_preset):
    from sdvg.models.reward import (build_image_reward, load_image_reward_weights, reward_tokenizer,
                                    save_image_reward_weights)

    cfg = tiny_preset.reward
    tok = reward_tokenizer(cfg, tiny=True)
    save_image_reward_weights(build_image_reward(cfg, tok), tmp_path / "ImageReward.pt")
    key = "blip.visual_encoder.blocks.1.attn.qkv.weight"
    _poison(tmp_path / "ImageReward.pt", key, "nan", count=2)
    with pytest.raises(CheckpointError, match=rf"ImageReward.pt: 1 unusable.*{key!r}: non-finite values \(2 NaN"):
        load_image_reward_weights(build_image_reward(cfg, tok), tmp_path / "ImageReward.pt")


def test_text_encoder_nan_and_int8_refused(tmp_path, tiny_preset):
    from sdvg.models.text_encoder import TextEncoder
    from sdvg.models.tokenizers import tiny_umt5_tokenizer

    enc = TextEncoder.random(tiny_preset.text_encoder, tiny_umt5_tokenizer(), seed=1)
    enc.model.save_pretrained(tmp_path / "te")
    enc.tokenizer.save_pretrained(tmp_path / "te")
    f = tmp_path / "te" / "model.safetensors"
    key = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    clean = load_file(str(f))
    _poison(f, key, "nan", count=4)
    with pytest.raises(CheckpointError, match=rf"te: 1 unusable.*{key!r}: non-finite values \(4 NaN, 0 inf\).*{FIX}"):
        TextEncoder.from_pretrained(tmp_path / "te", config=tiny_preset.text_encoder)
    save_file(clean, str(f))
    _poison(f, key, "int8")
    with pytest.raises(CheckpointError, match=rf"model.safetensors: 1 unusable.*{key!r}: dtype I8, not a floating"):
        TextEncoder.from_pretrained(tmp_path / "te", config=tiny_preset.text_encoder)


@pytest.mark.slow
def test_real_pipeline_files_one_poisoned(tmp_path, tiny_pipe, tiny_preset):
    """The files of a whole pipeline in their real formats: the poisoned one is named, the clean ones load."""
    from sdvg import SpeculativeVideoPipeline

    paths = write_real_checkpoints(tiny_pipe.components, tmp_path)
    loaded = SpeculativeVideoPipeline.from_pretrained(tiny_preset, **paths, drafter_device="cpu")
    assert torch.equal(loaded.components.target.model.proj_out.bias, tiny_pipe.components.target.model.proj_out.bias)
    _poison(paths["target"], "model.head.head.bias", "nan")
    with pytest.raises(CheckpointError, match=r"krea.safetensors: 1 unusable.*'model.head.head.bias'"):
        SpeculativeVideoPipeline.from_pretrained(tiny_preset, **paths, drafter_device="cpu")


def test_the_finite_check_is_one_sum_when_clean():
    assert nonfinite_counts(torch.randn(1000)) == (0, 0)
    big = torch.full((4,), 60000.0, dtype=torch.float16)  # the sum overflows fp16: counted, not refused
    assert nonfinite_counts(big) == (0, 0)
    t = torch.randn(3 * (1 << 24) // 2)  # more than one counting chunk
    t[5], t[-1], t[1 << 24] = math.nan, math.inf, -math.inf
    assert nonfinite_counts(t) == (1, 2)
    assert nonfinite_counts(torch.empty(0)) == (0, 0)
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.tensor([1.0, math.nan, 2.0]).to(torch.float8_e4m3fn)
        assert nonfinite_counts(f8) == (1, 0)
    check_weights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}, "x")
    with pytest.raises(CheckpointError, match=r"x: 1 unusable tensor\(s\): 'b': dtype torch.bool"):
        check_weights({"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bool)}, "x")


# ----------------------------------------------------------------------------- runtime guard
PROMPT = "a red fox running through fresh snow"
NB = 4
SCHEDULERS = [("reference", False), ("cpp", False), ("cpp", True)]  # (scheduler, run_ahead)
# the fast tier: the reference loop and the native scheduler with run-ahead (its drafter on a thread of its own);
# the native scheduler without run-ahead runs the same guard in the whole suite
FAST_SCHEDULERS = [("reference", False), ("cpp", True)]


def _schedulers(fast=FAST_SCHEDULERS):
    return [case if case in fast else pytest.param(*case, marks=pytest.mark.slow) for case in SCHEDULERS]


@contextmanager
def poisoned_output(dit, block, frames_per_block=3, count=12):
    """NaN in the first `count` values of `dit`'s last denoising forward of `block` (full context: the
    block sits at its absolute frame; the last step's output becomes the latents elementwise)."""
    from sdvg.config import RoleContext
    from sdvg.generation.prepare import role_schedule

    last_t = float(torch.tensor(role_schedule(get_preset("tiny"), RoleContext()).timesteps[-1]))  # as fed (fp32)

    def hook(module, args, kwargs, out):
        if kwargs.get("frame_offset") == block * frames_per_block and float(args[1].flatten()[0]) == last_t:
            out = out.clone()
            out.view(-1)[:count] = math.nan
            return out
        return None

    handle = dit.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _blocks(pipe, opts, scheduler, run_ahead=False, comps=None, runners=None):
    comps = comps or pipe.components
    opts = pipe.resolve(opts)
    if scheduler == "reference":
        return list(generate_blocks(comps, PROMPT, opts, runners=runners))
    return list(generate_blocks_native(comps, PROMPT, opts.replace(run_ahead=run_ahead), runners=runners))


@pytest.mark.parametrize("scheduler,run_ahead", _schedulers())  # slow: cpp-False; the guard stays fast in cpp-True
def test_nan_in_the_target_output_names_the_stage_and_block(tiny_pipe, scheduler, run_ahead):
    opts = GenerationOptions(num_blocks=NB, seed=3, tau=math.inf)
    with poisoned_output(tiny_pipe.components.target, 2), \
            pytest.raises(NonFiniteError, match=r"^target output of block 2 holds 12 NaN values; ") as err:
        _blocks(tiny_pipe, opts, scheduler, run_ahead)
    assert (err.value.stage, err.value.block) == ("target", 2)


@pytest.mark.slow
@pytest.mark.parametrize("policy,pattern,rejected", [("committed", "0101", [2]), ("own", "0100", [2, 3])])
@pytest.mark.parametrize("scheduler,run_ahead", SCHEDULERS)
def test_nan_draft_is_rejected_with_a_warning_and_the_target_makes_the_block(tiny_pipe, scheduler, run_ahead, policy,
                                                                             pattern, rejected):
    """tau = -inf accepts every draft; the poisoned draft of block 2 is rejected instead (under `own` the
    drafter's context then holds it, so block 3's draft is non-finite and rejected too). The video is
    the one a clean run with those decisions fixed (pattern router) makes."""
    opts = GenerationOptions(num_blocks=NB, seed=3, tau=-math.inf, drafter_context=policy)
    with poisoned_output(tiny_pipe.components.drafter, 2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _blocks(tiny_pipe, opts, scheduler, run_ahead)
    msgs = [str(w.message) for w in caught if issubclass(w.category, NonFiniteDraftWarning)]
    assert msgs[0].startswith("drafter output of block 2 holds 12 NaN values: the draft is rejected and the target "
                              "makes block 2.")
    assert len(msgs) == len(rejected) and all(f"block {b} holds" in m for b, m in zip(rejected, msgs))
    clean = _blocks(tiny_pipe, GenerationOptions(num_blocks=NB, seed=3, router="pattern", pattern=pattern,
                                                 drafter_context=policy), "reference")
    assert [b.decision for b in got] == [b.decision for b in clean] == \
        ["forced"] + ["rejected" if b in rejected else "accepted" for b in range(1, NB)]
    for a, b in zip(got, clean):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
    for b in rejected:
        assert math.isnan(got[b].score) and got[b].frame_scores == []  # neither decoded nor scored
        assert torch.isnan(got[b].draft_latents).sum() > 0


@pytest.mark.slow
def test_both_schedulers_agree_on_a_poisoned_draft(tiny_pipe):
    opts = GenerationOptions(num_blocks=NB, seed=3, tau=-math.inf, score_emitted=True)
    with poisoned_output(tiny_pipe.components.drafter, 2), warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteDraftWarning)
        ref = _blocks(tiny_pipe, opts, "reference")
        cpp = _blocks(tiny_pipe, opts, "cpp", run_ahead=True)
    for a, b in zip(ref, cpp):
        assert (a.index, a.decision) == (b.index, b.decision)
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
        assert a.frame_scores == b.frame_scores and a.emitted_scores == b.emitted_scores
        assert a.score == b.score or (math.isnan(a.score) and math.isnan(b.score))
        assert torch.equal(a.draft_latents.nan_to_num(7.0), b.draft_latents.nan_to_num(7.0))


def _poison_calls(runners, name, calls, value=math.nan):
    """Wrap `runners.<name>` so that its `calls`-th calls (1-based) return a NaN in their output."""
    real, n = getattr(runners, name), [0]

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        n[0] += 1
        if n[0] in calls:
            out = out.clone()
            out.view(-1)[0] = value
        return out

    setattr(runners, name, wrapped)
    return runners


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["reference", "cpp"])
def test_nan_in_the_decode_and_the_scores(tiny_pipe, scheduler):
    from sdvg.generation.backends import StageRunners

    comps = tiny_pipe.components
    # mode target: the decode of block 1 is the emitted block
    runners = _poison_calls(StageRunners(comps), "decode", {2})
    with pytest.raises(NonFiniteError, match=r"^decode output of block 1 holds 1 NaN value; "):
        _blocks(tiny_pipe, GenerationOptions(mode="target", num_blocks=NB, seed=3), scheduler, runners=runners)
    # committed context, tau = -inf: decode calls are target 0, draft 1, draft 2, ...: the draft of block 2
    # decodes to NaN -> rejected, the target makes it (decode call 4)
    opts = GenerationOptions(num_blocks=NB, seed=3, tau=-math.inf, drafter_context="committed")
    runners = _poison_calls(StageRunners(comps), "decode", {3})
    with pytest.warns(NonFiniteDraftWarning, match="VAE decode of the draft of block 2 holds 1 NaN value: the draft"):
        got = _blocks(tiny_pipe, opts, scheduler, runners=runners)
    assert [b.decision for b in got] == ["forced", "accepted", "rejected", "accepted"]
    assert math.isnan(got[2].score) and got[2].frame_scores == []
    # the scores: a draft's NaN score rejects it (its frame scores are kept); an emitted frame's raises
    runners = _poison_calls(StageRunners(comps), "score", {2})  # score calls: draft 1, draft 2, ...
    with pytest.warns(NonFiniteDraftWarning, match="reward scores of the draft of block 2 hold 1 NaN value"):
        got = _blocks(tiny_pipe, opts, scheduler, runners=runners)
    assert got[2].decision == "rejected" and math.isnan(got[2].frame_scores[0]) and math.isnan(got[2].score)
    runners = _poison_calls(StageRunners(comps), "score", {1}, math.inf)  # score_emitted: block 0's frames
    with pytest.raises(NonFiniteError, match=r"^reward scores of the emitted frames of block 0 hold 1 inf value"):
        _blocks(tiny_pipe, opts.replace(score_emitted=True, tau=math.inf), scheduler, runners=runners)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["reference", "cpp"])
def test_routers_without_scores_and_draft_mode(tiny_pipe, scheduler):
    """random / pattern decide in advance: a NaN draft they reject anyway is rejected with the warning
    (also without a reward model), one they would accept is an error; in mode draft it is an error."""
    import dataclasses

    no_reward = dataclasses.replace(tiny_pipe.components, scorer=None)
    drafter = tiny_pipe.components.drafter
    with poisoned_output(drafter, 2), pytest.warns(NonFiniteDraftWarning, match="drafter output of block 2"):
        got = _blocks(tiny_pipe, GenerationOptions(num_blocks=NB, seed=3, router="pattern", pattern="0101",
                                                   drafter_context="committed"), scheduler, comps=no_reward)
    assert [b.decision for b in got] == ["forced", "accepted", "rejected", "accepted"] and got[2].score is None
    with poisoned_output(drafter, 2), pytest.raises(
            NonFiniteError, match=r"drafter output of block 2 holds 12 NaN values; router 'random' accepts block 2"):
        _blocks(tiny_pipe, GenerationOptions(num_blocks=NB, seed=3, router="random", accept_prob=1.0), scheduler)
    with poisoned_output(drafter, 1), pytest.raises(
            NonFiniteError, match=r"drafter output of block 1 holds 12 NaN values; in mode 'draft' the draft is"):
        _blocks(tiny_pipe, GenerationOptions(mode="draft", num_blocks=NB, seed=3), scheduler)


NEW_ROUTERS = [dict(router="pattern", pattern="1111"), dict(router="random", accept_prob=1.0)]
# slow: four of the six; each router and each scheduler stays fast in one case: the pattern on the reference loop,
# the random router on the native scheduler with run-ahead
FAST_ROUTER_CASES = {(0, "reference", False), (1, "cpp", True)}


@pytest.mark.parametrize("new_router,scheduler,run_ahead", [
    pytest.param(router, *case, id=f"new_router{i}-{case[0]}-{case[1]}",
                 marks=() if (i, *case) in FAST_ROUTER_CASES else pytest.mark.slow)
    for i, router in enumerate(NEW_ROUTERS) for case in SCHEDULERS])
def test_a_live_router_change_is_the_guards_router_too(tiny_pipe, scheduler, run_ahead, new_router):
    """A live session starts under the reward router (tau=-inf) and switches after block 0 to a router that
    accepts without looking; the drafter's block 2 is NaN. The block's own router decides: it would accept the
    draft, so the run stops with NonFiniteError naming block 2; never an `accepted` block with NaN latents (the
    guard once kept the video's first router, warned 'rejected' while the scheduler accepted the NaN draft)."""
    session = tiny_pipe.session(PROMPT, num_blocks=NB, seed=3, tau=-math.inf, drafter_context="committed",
                                scheduler=scheduler, run_ahead=run_ahead)
    emitted = []
    with poisoned_output(tiny_pipe.components.drafter, 2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError, match=r"^drafter output of block 2 holds 12 NaN values; router") as err:
            for record in session:
                emitted.append(record)
                if record.index == 0:
                    ack = session.update(**new_router)
                    assert ack.block <= 2, ack  # the switch reaches the poisoned block
        session.close()
    assert (err.value.stage, err.value.block) == ("draft", 2)
    assert all(torch.isfinite(r.latents).all() for r in emitted) and [r.index for r in emitted] in ([0], [0, 1])
    assert not [w for w in caught if issubclass(w.category, NonFiniteDraftWarning)]  # no 'rejected' said


@pytest.mark.parametrize("scheduler,run_ahead", _schedulers())  # slow: cpp-False; the switch stays fast in cpp-True
def test_a_live_switch_to_the_reward_router_rejects_the_nan_draft(tiny_pipe, scheduler, run_ahead):
    """The other way: a session under a pattern that accepts everything switches to the reward router (tau=-inf)
    after block 0: the NaN draft of block 2 is rejected with the warning and the target makes it."""
    session = tiny_pipe.session(PROMPT, num_blocks=NB, seed=3, router="pattern", pattern="1111",
                                drafter_context="committed", scheduler=scheduler, run_ahead=run_ahead)
    got = []
    with poisoned_output(tiny_pipe.components.drafter, 2), \
            pytest.warns(NonFiniteDraftWarning, match="drafter output of block 2 holds 12 NaN values: the draft is"):
        for record in session:
            got.append(record)
            if record.index == 0:
                assert session.update(router="reward", tau=-math.inf).block <= 2
    assert [r.decision for r in got][2] == "rejected"
    assert all(torch.isfinite(r.latents).all() for r in got)
