import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from sdvg.generation.prepare import allocate_cache
from sdvg.generation.reference import generate_blocks
from sdvg.generation.role_model import RoleModel
from sdvg.generation.types import LoopReport
from sdvg.options import GenerationOptions
from sdvg.generation.routers import acceptance_pattern

PROMPT = "a red fox running through fresh snow"
NB = 4


@pytest.mark.slow
def test_tau_plus_inf_is_exactly_target_only(tiny_pipe):
    sd = tiny_pipe(PROMPT, tau=math.inf, num_blocks=NB, seed=3)
    tgt = tiny_pipe(PROMPT, mode="target", num_blocks=NB, seed=3)
    assert [b["decision"] for b in sd.stats["blocks"]] == ["forced"] + ["rejected"] * (NB - 1)
    assert torch.equal(sd.latents, tgt.latents)
    assert np.array_equal(sd.frames, tgt.frames)
    assert sd.stats["result"]["acceptance_rate"] == 0.0


@pytest.mark.slow
def test_tau_minus_inf_gives_target_block0_then_drafts(tiny_pipe):
    sd = tiny_pipe(PROMPT, tau=-math.inf, num_blocks=NB, seed=3)
    tgt = tiny_pipe(PROMPT, mode="target", num_blocks=1, seed=3)
    assert [b["decision"] for b in sd.stats["blocks"]] == ["forced"] + ["accepted"] * (NB - 1)
    assert torch.equal(sd.blocks[0][0].latents, tgt.blocks[0][0].latents)
    for blk in sd.blocks[0][1:]:
        assert torch.equal(blk.latents, blk.draft_latents)
    assert sd.stats["result"]["acceptance_rate"] == 1.0
    # Accepted blocks cost the target one commit forward at most; the trailing run costs nothing.
    assert sd.stats["result"]["target_forwards"] == 4 + 1
    assert sd.stats["result"]["skipped_target_commits"] == NB - 1


@pytest.mark.slow
def test_rejected_block_starts_from_the_draft_noise(tiny_pipe, monkeypatch):
    seen = []
    orig = RoleModel.denoise

    def spy(self, noise, block, frame0, seed, text_kv):
        seen.append((self.role, block, noise.clone()))
        return orig(self, noise, block, frame0, seed, text_kv)

    monkeypatch.setattr(RoleModel, "denoise", spy)
    out = tiny_pipe(PROMPT, router="pattern", pattern=(False, False, True, False), num_blocks=NB, seed=5,
                    skip_first_draft=False)
    decisions = [b["decision"] for b in out.stats["blocks"]]
    assert decisions == ["forced", "rejected", "accepted", "rejected"]
    for b in (0, 1, 3):
        d = [n for r, blk, n in seen if r == "drafter" and blk == b]
        t = [n for r, blk, n in seen if r == "target" and blk == b]
        assert len(d) == 1 and len(t) == 1 and torch.equal(d[0], t[0])


@pytest.mark.parametrize("policy", ["committed", "own"])
def test_drafter_cache_holds_what_the_policy_says(tiny_pipe, policy):
    comps = tiny_pipe.components
    opts = tiny_pipe.resolve(GenerationOptions(router="pattern", pattern="001", num_blocks=3, seed=7,
                                               drafter_context=policy))
    report = LoopReport()
    blocks = list(generate_blocks(comps, PROMPT, opts, report))
    assert [b.decision for b in blocks] == ["forced", "rejected", "accepted"]
    cache = report.drafter_cache
    # Rebuild the expected drafter context by committing the latents the policy names.
    expected = allocate_cache(comps, comps.drafter, comps.drafter_device, opts.role_context("drafter"), 3)
    text = comps.drafter.encode_text(comps.text_encoder.encode(PROMPT))
    pick = (lambda blk: blk.latents) if policy == "committed" else (lambda blk: blk.draft_latents)
    assert not torch.equal(blocks[1].latents, blocks[1].draft_latents)
    if policy == "own":
        assert blocks[0].draft_latents is not None  # `own` drafts block 0 for its own context
    for b, lat in ((0, pick(blocks[0])), (1, pick(blocks[1]))):
        comps.drafter(lat, torch.zeros(1, 3), text, frame_offset=3 * b, cache=expected)
        expected.commit()
    tokens = 6 * 16
    assert torch.equal(cache.buffer[:, :, :, :, :tokens], expected.buffer[:, :, :, :, :tokens])


@pytest.mark.slow
def test_frames_total_and_emitted_equal_streaming_decode(tiny_pipe):
    out = tiny_pipe(PROMPT, tau=0.0, num_blocks=NB, seed=2, output_type="uint8")
    assert out.frames.shape == (1, 9 + 12 * (NB - 1), 64, 64, 3)  # a batch of one
    assert out.stats["video"]["frames"] == out.frames.shape[1]
    from sdvg.models.vae import to_uint8_frames

    dec = tiny_pipe.components.vae
    assert torch.equal(to_uint8_frames(dec.decode_video(out.latents)), out.frames[0])


@pytest.mark.slow
def test_stats_schema(tiny_pipe):
    out = tiny_pipe(PROMPT, tau=-0.12, num_blocks=NB, seed=2, drafter_context="committed")
    s = out.stats
    assert "blocks" in s and {"acceptance_rate", "target_forwards", "drafter_forwards", "wall_s"} <= set(s["result"])
    assert "frames" in s["video"]
    for b in s["blocks"]:
        assert set(b) >= {"index", "decision", "score", "frame_scores", "times"}
        assert set(b["times"]) >= {"draft", "decode", "score", "target", "commit"}
    assert s["blocks"][0]["decision"] == "forced" and s["blocks"][0]["frame_scores"] == []  # draft skipped
    assert s["result"]["skipped_drafter_forwards"] == 4
    assert all(len(b["frame_scores"]) == 12 for b in s["blocks"][1:])
    later = s["blocks"][1:]
    assert s["result"]["acceptance_rate"] == sum(b["decision"] == "accepted" for b in later) / (NB - 1)
    json.dumps(s.as_dict(), allow_nan=False)


def test_random_router_hits_requested_rate(tiny_pipe):
    from sdvg.generation.routers import Router

    r = Router.from_options(GenerationOptions(router="random", accept_prob=0.7))
    n = 4000
    rate = sum(r.accept(b, None, seed=11) for b in range(n)) / n
    assert abs(rate - 0.7) < 4 * math.sqrt(0.7 * 0.3 / n)
    out = tiny_pipe(PROMPT, router="random", accept_prob=1.0, num_blocks=2, seed=1)
    assert out.stats["result"]["acceptance_rate"] == 1.0


def test_acceptance_pattern_exact():
    p = acceptance_pattern(9, 0.731, seed=0)
    assert p[0] is False and sum(p[1:]) == round(0.731 * 8)
    assert acceptance_pattern(9, 0.5) == acceptance_pattern(9, 0.5)


@pytest.mark.slow
def test_same_seed_same_video_different_seed_differs(tiny_pipe):
    a = tiny_pipe(PROMPT, tau=-0.1, num_blocks=2, seed=9)
    b = tiny_pipe(PROMPT, tau=-0.1, num_blocks=2, seed=9)
    c = tiny_pipe(PROMPT, tau=-0.1, num_blocks=2, seed=10)
    assert torch.equal(a.latents, b.latents) and np.array_equal(a.frames, b.frames)
    assert not torch.equal(a.latents, c.latents)


def test_draft_mode_uses_only_the_drafter(tiny_pipe):
    out = tiny_pipe(PROMPT, mode="draft", num_blocks=2, seed=1)
    assert out.stats["result"]["target_forwards"] == 0 and out.stats["result"]["drafter_forwards"] == 4 + 1 + 4
    assert out.stats["result"]["acceptance_rate"] is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(tau=float("nan")), "NaN"),
    (dict(mode="fast"), "unknown mode"),
    (dict(router="oracle"), "unknown router"),
    (dict(aggregation="median"), "unknown aggregation"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(drafter_context="mine"), "unknown drafter_context"),
    (dict(router="pattern"), "needs a decision pattern"),
    (dict(pattern="0120"), "only 0 and 1"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(num_blocks=True), "num_blocks must be an integer"),
    (dict(tau=None), "tau must be a number"),
    (dict(scheduler="reference", run_ahead=True), "run_ahead needs scheduler 'cpp'"),
])
def test_bad_generation_arguments(tiny_pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_pipe(PROMPT, **kwargs)


def test_bad_prompt_and_preset(tiny_pipe):
    from sdvg import ConfigError, SpeculativeVideoPipeline

    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_pipe("   ")
    with pytest.raises(ConfigError, match="unknown preset"):
        SpeculativeVideoPipeline.from_preset("huge")
    from sdvg.config import VideoConfig

    with pytest.raises(ConfigError, match="multiple of 16"):
        SpeculativeVideoPipeline.from_preset("tiny", video=VideoConfig(height=70, width=64))


def test_mismatched_drafter_and_target_refused(tiny_pipe):
    import dataclasses

    from sdvg.config import ConfigError, get_preset

    p = get_preset("tiny")
    bad = dataclasses.replace(p, drafter=dataclasses.replace(p.drafter, text_dim=48))
    with pytest.raises(ConfigError, match="text_dim"):
        bad.validate()


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sdvg.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _in_process(capsys, *args):
    """The same command line through `sdvg.cli.main(argv)` in this process (what `python -m sdvg.cli` runs,
    without a new interpreter importing torch): its exit status (argparse's refusals exit 2), stdout, stderr."""
    from sdvg.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


@pytest.mark.slow
def test_cli_generate_writes_mp4_and_stats(tmp_path):
    from sdvg.io.video_writer import read_mp4_frames

    r = _cli("generate", "--preset", "tiny", "--prompt", PROMPT, "--num-blocks", "2", "--tau", "-0.1",
             "--out", str(tmp_path / "v.mp4"), "--stats", str(tmp_path / "s.json"), "--quiet",
             "--timeline", str(tmp_path / "t.png"))
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["video"]["frames"] == 21 and len(stats["blocks"]) == 2
    # the default drafter context `own` drafts block 0 too (the paper's rule), then the target makes it
    assert [(s["block"], s["stage"]) for s in stats["trace"]][:4] == [(0, "draft"), (0, "decode"), (0, "score"),
                                                                       (0, "target")]
    assert stats["options"]["drafter_context"] == "own" and stats["options"]["target_context"] == "full"
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_mp4_frames(tmp_path / "v.mp4").shape[0] == 21


@pytest.mark.slow
def test_cli_prompts_file_resume_and_bad_files(tmp_path, capsys):
    pf = tmp_path / "p.txt"
    pf.write_text("a cat\na dog\n")
    args = ["generate", "--preset", "tiny", "--prompts-file", str(pf), "--num-blocks", "1", "--out",
            str(tmp_path / "v.mp4"), "--stats", str(tmp_path / "s.jsonl"), "--quiet"]
    assert _cli(*args).returncode == 0  # the real command; the rest through its main() in this process
    recs = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["cli"]["prompt_index"] for r in recs] == [0, 1]
    assert (tmp_path / "v_0000.mp4").is_file() and (tmp_path / "v_0001.mp4").is_file()
    pf.write_text("a cat\na dog\na bird\n")
    assert _in_process(capsys, *args, "--resume").returncode == 0
    recs = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["cli"]["prompt_index"] for r in recs] == [0, 1, 2]  # only the new prompt ran
    pf.write_text("a cat\n\na dog\n")
    r = _in_process(capsys, *args)
    assert r.returncode != 0 and "blank lines at [2]" in r.stderr
    pf.write_bytes(b"a cat\n\xff\xfe bad\n")
    r = _in_process(capsys, *args)
    assert r.returncode != 0 and "not valid UTF-8" in r.stderr
    r = _in_process(capsys, "generate", "--preset", "tiny", "--prompt", "x", "--tau", "nan")
    assert r.returncode != 0 and "NaN" in r.stderr
    r = _in_process(capsys, "generate", "--preset", "nope", "--prompt", "x", "--out", str(tmp_path / "n.mp4"))
    assert r.returncode != 0 and "unknown preset" in r.stderr


@pytest.mark.slow
def test_one_line_prompts_file_follows_the_prompts_file_rule(tmp_path, capsys):
    pf = tmp_path / "one.txt"
    pf.write_text("a cat\n")
    args = ["generate", "--preset", "tiny", "--prompts-file", str(pf), "--num-blocks", "1", "--out",
            str(tmp_path / "v.mp4"), "--quiet", "--resume"]
    assert _cli(*args).returncode == 0  # the real command; the rest through its main() in this process
    assert (tmp_path / "v_0000.mp4").is_file() and not (tmp_path / "v.mp4").exists()
    recs = [json.loads(x) for x in (tmp_path / "v.jsonl").read_text().splitlines()]  # JSON Lines, named .jsonl
    assert [r["cli"]["prompt_index"] for r in recs] == [0]
    r = _in_process(capsys, *args)
    assert r.returncode == 0 and "nothing to resume" in r.stderr  # resumed: nothing left to do (said before loading)
    r = _in_process(capsys, "generate", "--preset", "tiny", "--prompt", "x", "--prompts-file", str(pf))
    assert r.returncode != 0 and "either --prompt TEXT or --prompts-file FILE" in r.stderr


@pytest.mark.slow
def test_interrupt_leaves_playable_mp4_and_marked_stats(tmp_path, tiny_pipe, monkeypatch):
    import sdvg.pipeline as pipeline
    from sdvg import cli
    from sdvg.io.video_writer import read_mp4_frames

    opts = GenerationOptions(tau=-0.1, num_blocks=4, seed=0)
    complete = cli.run_one(tiny_pipe, PROMPT, opts, tmp_path / "c.mp4", progress=False)
    real_run_blocks = pipeline.run_blocks

    def interrupted_blocks(*args, **keywords):  # the blocks a pipe.run stream iterates: Ctrl-C at the third
        inner = real_run_blocks(*args, **keywords)

        def blocks():
            for i, block in enumerate(inner):
                if i == 2:
                    inner.close()
                    raise KeyboardInterrupt
                yield block

        return blocks()

    monkeypatch.setattr(pipeline, "run_blocks", interrupted_blocks)
    stats = cli.run_one(tiny_pipe, PROMPT, opts, tmp_path / "i.mp4", progress=False)
    assert stats["video"]["interrupted"] is True and len(stats["blocks"]) == 2 and stats["video"]["frames"] == 9 + 12
    assert set(stats) == set(complete)  # an interrupted run's stats have the same fields
    assert read_mp4_frames(tmp_path / "i.mp4").shape[0] == 9 + 12


@pytest.mark.slow
def test_memory_command_budget(capsys):
    """The 14B target fits a 48 GB card (44.7 GiB) under Krea's recompute context and not under full."""
    r = _cli("memory", "--preset", "wan2.1", "--budget-gib", "44.7")  # the real command
    assert r.returncode == 0, r.stderr
    target = r.stdout.split("device cuda:1:")[1]
    assert "target KV cache                  7.14 GiB   (recompute: 6 frames x 1560 tokens x 40 layers" in target
    assert "total                           34.15 GiB   fits the budget of 44.7 GiB" in target
    # the rest through its main() in this process
    r = _in_process(capsys, "memory", "--preset", "wan2.1", "--budget-gib", "44.7", "--target-context", "full")
    assert r.returncode == 2  # the device, what it needs, the budget and the fix are named
    assert all(s in r.stderr for s in ("cuda:1", "59.14 GiB", "44.7 GiB", "recompute target context"))
    r = _in_process(capsys, "memory", "--preset", "wan2.1", "--json", "--target-device", "cuda:0")
    plan = json.loads(r.stdout)
    assert plan["kv_cache_gib_per_mode"]["target"]["full"] > 32 and plan["contexts"]["target"] == "recompute"
    assert list(plan["device_total_gib"]) == ["cuda:0"]  # one device: every component summed on it
    assert plan["device_total_gib"]["cuda:0"] == pytest.approx(sum(it["gib"] for it in plan["items"]))
    for bad in ("nan", "-1"):
        assert _in_process(capsys, "memory", "--budget-gib", bad).returncode == 2


@pytest.mark.slow
def test_bf16_pipeline_runs_and_keeps_fp32_parts():
    from sdvg import SpeculativeVideoPipeline

    pipe = SpeculativeVideoPipeline.from_preset("tiny", precision="bf16")
    target = pipe.components.target
    assert target.dtype == torch.bfloat16
    assert target.model.blocks[0].scale_shift_table.dtype == torch.float32  # kept in fp32, as diffusers does
    assert target.model.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    out = pipe(PROMPT, tau=-0.1, num_blocks=2, seed=0)
    assert out.frames.shape == (1, 21, 64, 64, 3) and torch.isfinite(out.latents).all()


@pytest.mark.slow
def test_from_pretrained_with_real_formats_equals_the_source(tmp_path, tiny_pipe, tiny_preset):
    """Every component written in its real on-disk format and loaded back gives the same video."""
    from conftest import write_real_checkpoints

    from sdvg import SpeculativeVideoPipeline

    paths = write_real_checkpoints(tiny_pipe.components, tmp_path)
    loaded = SpeculativeVideoPipeline.from_pretrained(tiny_preset, **paths, drafter_device="cpu")
    kw = dict(tau=-0.105, num_blocks=3, seed=4)
    a, b = tiny_pipe(PROMPT, **kw), loaded(PROMPT, **kw)
    assert [x["score"] for x in a.stats["blocks"]] == [x["score"] for x in b.stats["blocks"]]
    assert torch.equal(a.latents, b.latents) and np.array_equal(a.frames, b.frames)


def test_timeline_refuses_stats_without_trace(tmp_path):
    from sdvg.evaluation.timeline import plot_timeline

    with pytest.raises(ValueError, match="no stage trace"):
        plot_timeline([{"title": "old stats", "trace": []}], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
