"""The one declaration of the generation options, and everything derived from it: the API keywords,
the CLI flags, the statistics fields and the native scheduler's config."""
import argparse
import dataclasses
import inspect
import math

import pytest

from sdvg.options import (DEFAULTS, OPTION_NAMES, GenerationOptions, OptionError, add_option_flags, flag_of,
                          options_from_args, parse_pattern)

# a value other than the default for every option (all valid together)
CHANGED = dict(mode="target", tau=-1.5, num_blocks=2, seed=7, router="pattern", accept_prob=0.25, pattern=(True, False),
               aggregation="mean", force_first_reject=False, drafter_context="committed", skip_first_draft=False,
               target_context="recompute", drafter_cache="recompute", kv_cache_frames=2, keep_first_frame=True,
               window_frames=6, sink_frames=3,
               lazy_target_commit=False, score_emitted=True, scheduler="cpp", run_ahead=True, run_ahead_blocks=3,
               early_exit="target", exit_verifier="head", exit_eps=0.1, exit_thresholds=(0.4, 0.3),
               exit_head="head.safetensors", exit_pattern_steps=2.0, cuda_graphs=True,
               fast_vae=True, stage_timing="events", vae_decoder="krea", interp_blocks=2, strength=0.6, target_steps=3, force_reject_after_switch=False, recache=False, backend="eager",
               quantization="fp8")
CLI_TEXT = dict(mode="target", tau="-1.5", num_blocks="2", seed="7", router="pattern", accept_prob="0.25",
                pattern="10", aggregation="mean", drafter_context="committed", target_context="recompute",
                drafter_cache="recompute", kv_cache_frames="2", window_frames="6", sink_frames="3",
                run_ahead_blocks="3", scheduler="cpp", early_exit="target", exit_verifier="head", exit_eps="0.1",
                exit_thresholds="0.4,0.3", exit_head="head.safetensors", exit_pattern_steps="2.0", stage_timing="events",
                vae_decoder="krea", backend="eager", interp_blocks="2", strength="0.6", target_steps="3", quantization="fp8")


def test_changed_covers_every_option():
    assert set(CHANGED) == set(OPTION_NAMES)
    for name, value in CHANGED.items():
        if name != "scheduler":  # cpp is both the default and the only scheduler with run-ahead
            assert getattr(DEFAULTS, name) != value, name


@pytest.mark.parametrize("method", ["__call__", "stream"])
def test_api_keywords_match_the_declaration(method):
    from sdvg.pipeline import API_KEYWORDS, SpeculativeVideoPipeline

    params = list(inspect.signature(getattr(SpeculativeVideoPipeline, method)).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "prompt"]
    keywords = params[2:]
    extra = ["prompt_schedule", "input_video", "start_frame"] + (list(API_KEYWORDS) if method == "__call__" else [])  # not options
    assert [p.name for p in keywords] == list(OPTION_NAMES) + extra
    keywords = keywords[:len(OPTION_NAMES)]
    for p in keywords:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p.name
        assert p.default == getattr(DEFAULTS, p.name), p.name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _parser(exclude=()):
    ap = argparse.ArgumentParser()
    add_option_flags(ap, exclude=exclude)
    return ap


def test_cli_defaults_are_the_declaration():
    assert options_from_args(_parser().parse_args([])) == DEFAULTS


def test_every_cli_flag_reaches_its_option():
    argv = []
    for name in OPTION_NAMES:
        default = getattr(DEFAULTS, name)
        if isinstance(default, bool):
            argv.append(flag_of(name) if CHANGED[name] else "--no-" + flag_of(name)[2:])
        else:
            argv += [flag_of(name), CLI_TEXT[name]]
    assert options_from_args(_parser().parse_args(argv)) == GenerationOptions(**CHANGED)


def test_generate_sweep_and_calibrate_derive_their_flags():
    from sdvg.cli import build_parser

    sub = {a.dest: a for a in build_parser()._subparsers._group_actions}["command"].choices
    for command, missing in (("generate", set()), ("sweep", {"mode", "tau"}), ("calibrate", {"mode", "tau"})):
        dests = {a.dest for a in sub[command]._actions}
        assert set(OPTION_NAMES) - dests == missing, command


def test_stats_carry_every_option(tiny_pipe):
    out = tiny_pipe("a cat", num_blocks=2, router="pattern", pattern="01", accept_prob=0.5)
    stats = out.stats.as_dict()
    assert list(stats["options"]) == list(OPTION_NAMES)  # the options group: every option, in order
    assert stats["options"]["pattern"] == "01"
    assert stats["options"]["num_blocks"] == 2 and stats["options"]["backend"] == "eager"


def test_native_config_gets_every_field_by_name():
    from sdvg._native import _C
    from sdvg.generation.native import scheduler_config

    opts = GenerationOptions(**CHANGED).replace(router="random")
    cfg = scheduler_config(opts, 3, 4, False, True)
    assert cfg.num_blocks == 2 and not cfg.own_context and cfg.run_ahead
    assert not cfg.lazy_target_commit and cfg.run_ahead_blocks == 3 and cfg.target_recompute and cfg.drafter_steps == 4
    assert cfg.skips_first_draft == opts.skips_first_draft  # resolved once, by the options
    # no routing option reaches the scheduler: each block's plan carries its decision or threshold (plan.py)
    assert not {"router", "tau", "accept_prob", "pattern", "uniforms"} & set(_C.SchedulerConfig.FIELDS)


@pytest.mark.parametrize("changes,match", [
    (dict(tau=float("nan")), "NaN"),
    (dict(tau="0.5"), "tau must be a number"),
    (dict(tau=None), "tau must be a number"),
    (dict(seed=-1), "seed -1 must be an integer in"),
    (dict(seed=2**64), "must be an integer in"),
    (dict(seed="abc"), "seed must be an integer"),
    (dict(seed=None), "seed must be an integer"),
    (dict(num_blocks=True), "num_blocks must be an integer"),
    (dict(num_blocks=0), "num_blocks 0 must be an integer >= 1"),
    (dict(accept_prob=1.5), r"accept_prob 1.5 must lie in \[0, 1\]"),
    (dict(accept_prob=float("inf")), "accept_prob must be finite"),
    (dict(pattern="01x"), "only 0 and 1"),
    (dict(pattern=[1, 2]), "pattern entries must be bools"),
    (dict(pattern=5), "pattern must be a string"),
    (dict(router="pattern"), "needs a decision pattern"),
    (dict(mode="fast"), "unknown mode 'fast'; choose one of sdvg, target, draft"),
    (dict(backend="rust"), "unknown backend"),
    (dict(force_first_reject="yes"), "force_first_reject must be True or False"),
    (dict(scheduler="reference", run_ahead=True), "run_ahead needs scheduler 'cpp'"),
    (dict(kv_cache_frames=0), "kv_cache_frames 0 must be an integer >= 1"),
    (dict(target_context="ring"), "unknown target_context 'ring'; choose one of full, recompute"),
    (dict(run_ahead_blocks=0), "run_ahead_blocks 0 must be an integer >= 1"),
    (dict(window_frames=-1), "window_frames -1 must be an integer >= 0"),
    (dict(early_exit="all"), "unknown early_exit 'all'; choose one of none, target, drafter, both"),
    (dict(exit_verifier="magic"), "unknown exit_verifier"),
    (dict(exit_eps=float("nan")), "exit_eps is NaN"),
    (dict(exit_eps=-0.1), "exit_eps -0.1 must be >= 0"),
    (dict(exit_thresholds="0.5"), "two numbers RED,STAB"),
    (dict(exit_thresholds=(float("nan"), 0.3)), "exit_thresholds RED is NaN"),
    (dict(exit_thresholds=(0.5, -1)), "exit_thresholds STAB -1.0 must be >= 0"),
    (dict(exit_pattern_steps=0.5), "exit_pattern_steps 0.5 must be >= 1"),
    (dict(early_exit="target", exit_verifier="head"), "needs the learned head's file"),
    (dict(mode="target", early_exit="drafter"), "names a role that mode 'target' does not run"),
    (dict(quantization="int8"), "unknown quantization 'int8'; choose one of none, fp8, fp8-target, fp8-drafter"),
    (dict(quantization="fp8", backend="tensorrt"), "quantization 'fp8' runs the DiTs' linears in FP8, which only the "
                                                   "eager and compile backends run"),
])
def test_bad_values_are_refused_by_name(changes, match):
    with pytest.raises(OptionError, match=match):
        GenerationOptions(**changes)


def test_pattern_forms_and_infinite_tau():
    assert parse_pattern("0110") == parse_pattern([False, True, True, False]) == parse_pattern((0, 1, 1, 0))
    assert GenerationOptions(pattern="0101").pattern == (False, True, False, True)  # "0" is not accepted
    assert GenerationOptions(tau=-math.inf).tau == -math.inf
    opts = GenerationOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.tau = 1.0


def test_cli_refuses_bad_values_with_exit_2(capsys):
    from sdvg import cli

    for argv, match in ((["--tau", "abc"], "not a number"), (["--pattern", "012"], "only 0 and 1"),
                        (["--seed", "1.5"], "not an integer"), (["--num-blocks", "0"], ">= 1")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--prompt", "x", *argv])
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


@pytest.mark.parametrize("changes,match", [
    (dict(target_context="recompute", kv_cache_frames=10), "kv_cache_frames 10 is larger than the video \\(9 latent"),
    (dict(mode="target", target_context="recompute", window_frames=6), "window_frames 6: a recompute context"),
    (dict(sink_frames=3), "sink_frames 3 needs a window"),
    (dict(window_frames=3, sink_frames=6), "sink_frames 6 exceeds window_frames 3"),
    (dict(drafter_cache="recompute", run_ahead=True), "without keep_first_frame"),
])
def test_rules_that_need_the_preset_are_checked_on_resolve(changes, match):
    from sdvg.config import get_preset

    with pytest.raises(OptionError, match=match):
        GenerationOptions(**changes).resolved(get_preset("tiny"))


def test_resolve_fills_the_preset_defaults_and_contexts():
    from sdvg.config import get_preset

    wan = GenerationOptions().resolved(get_preset("wan2.1"))
    assert (wan.num_blocks, wan.target_context, wan.drafter_cache, wan.kv_cache_frames) == (9, "recompute", "full", 3)
    ctx = wan.role_context("target")
    assert ctx.recompute and ctx.cache_frames(9, 3) == 6 and ctx.pixel_window() == 9 and not ctx.keep_first_frame
    assert wan.role_context("drafter").cache_frames(9, 3) == 27
    tiny = GenerationOptions().resolved(get_preset("tiny"))
    assert (tiny.target_context, tiny.drafter_cache) == ("full", "full")
    # explicit values win over the preset's
    assert GenerationOptions(target_context="full").resolved(get_preset("wan2.1")).target_context == "full"
    with pytest.raises(OptionError, match="not resolved"):
        GenerationOptions().role_context("target")


def test_paper_protocol():
    from sdvg.options import describe_protocol, protocol_options

    opts = protocol_options("paper")
    assert (opts.drafter_context, opts.force_first_reject, opts.num_blocks, opts.seed) == ("own", True, 9, 42)
    assert protocol_options("paper", seed=3).seed == 3  # explicit options win
    lines = describe_protocol("paper", opts, 64, 64, random_weights=True)
    assert "resolution kept at the preset's 64x64" in lines[1] and "seed=42" in lines[0]
    assert "832x480 (the paper's)" in describe_protocol("paper", opts, 480, 832, random_weights=False)[1]
    with pytest.raises(OptionError) as e:
        protocol_options("iclr")
    assert "'iclr'" in str(e.value)


def test_method_and_run_options_partition_the_declaration():
    from sdvg.options import METHOD_OPTION_NAMES, RUN_OPTION_NAMES, MethodOptions, RunOptions

    assert not set(METHOD_OPTION_NAMES) & set(RUN_OPTION_NAMES)
    assert METHOD_OPTION_NAMES + RUN_OPTION_NAMES == OPTION_NAMES  # each declared once, method first
    assert {"mode", "tau", "router", "aggregation", "drafter_context", "force_first_reject", "early_exit",
            "target_context", "drafter_cache"} <= set(METHOD_OPTION_NAMES)
    assert {"scheduler", "backend", "run_ahead", "cuda_graphs", "stage_timing", "fast_vae",
            "quantization"} <= set(RUN_OPTION_NAMES)
    opts = GenerationOptions(**CHANGED)
    assert isinstance(opts.method, MethodOptions) and isinstance(opts.run, RunOptions)
    assert GenerationOptions(**dataclasses.asdict(opts.method), **dataclasses.asdict(opts.run)) == opts
    with pytest.raises(OptionError) as e:
        MethodOptions(tau=math.nan)  # each half validates its own fields
    assert all(s in str(e.value) for s in ("tau", "NaN")), e.value
    with pytest.raises(OptionError, match="run_ahead needs scheduler 'cpp'"):
        RunOptions(scheduler="reference", run_ahead=True)


@pytest.mark.parametrize("option", ["cuda_graphs", "fast_vae", "early_exit"])
def test_eager_only_options_are_refused_with_another_backend_at_construction(option):
    value = "target" if option == "early_exit" else True
    with pytest.raises(OptionError, match=rf"{option}.*eager"):
        GenerationOptions(mode="target", backend="compile", **{option: value})
    GenerationOptions(mode="target", backend="eager", **{option: value})  # fine on eager
    GenerationOptions(mode="target", **{option: value})  # backend unset: checked when resolved


def test_every_backend_has_one_registry_entry():
    from sdvg.generation.backends import REGISTRY
    from sdvg.options import BACKENDS

    assert tuple(REGISTRY) == BACKENDS
    # eager and compile run the eager loop (compile: its hot parts compiled); the engine backends run engines
    assert [name for name, b in REGISTRY.items() if not b.static] == ["eager", "compile"]
