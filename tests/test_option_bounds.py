"""Hostile option values (issue 35): sizes, ranges, None and deep nesting are refused by each option's own
validator in `sdvg.options` (the API, the CLI, live updates and the server all go through it), with an
OptionError naming the field, the bound and the fix; no message reprs a client's value unbounded."""
import dataclasses

import pytest

from sdvg.config import get_preset
from sdvg.live.updates import Update, UpdateError
from sdvg.options import DEFAULTS, FIELDS, MAX_STEPS, GenerationOptions, OptionError

# the bounds (sdvg.options: MAX_KV_CACHE_FRAMES, MAX_EXIT_EPS, MAX_PATTERN), written out: the messages name them
MAX_KV_CACHE_FRAMES, MAX_EXIT_EPS, MAX_PATTERN = 1024, 100.0, 1024


def _deep(depth: int = 1000):
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize("changes,match", [
    (dict(kv_cache_frames=1_000_000), r"kv_cache_frames 1000000 must be an integer in \[1, 1024\]; it is Krea's "
                                      r"kv_cache_num_frames.*default: 3"),
    (dict(kv_cache_frames=10**5000), r"kv_cache_frames <an integer of about 5000 digits> must be an integer in"),
    (dict(exit_eps=1e308), r"exit_eps 1e\+308 must lie in \[0, 100\]: it is a relative gap.*0.24 to 0.28"),
    (dict(exit_pattern_steps=1e308), r"exit_pattern_steps 1e\+308 must lie in \[1, 1000\]: it is a mean of "
                                     r"denoising steps"),
    (dict(pattern="0" * 5000), r"pattern has 5000 decisions; at most 1024: the pattern router cycles them"),
    (dict(pattern=[True] * 5000), r"pattern has 5000 decisions; at most 1024"),
])
def test_sizes_and_ranges_are_bounded_by_the_options_own_validator(changes, match):
    with pytest.raises(OptionError, match=match):
        GenerationOptions(**changes)


def test_each_bound_is_the_largest_value_taken():
    for name, bound, past in (("kv_cache_frames", MAX_KV_CACHE_FRAMES, MAX_KV_CACHE_FRAMES + 1),
                              ("exit_eps", MAX_EXIT_EPS, MAX_EXIT_EPS * 1.01),
                              ("exit_pattern_steps", MAX_STEPS, MAX_STEPS + 0.5),
                              ("pattern", "01" * (MAX_PATTERN // 2), "01" * (MAX_PATTERN // 2) + "1")):
        assert getattr(GenerationOptions(**{name: bound}), name) == (GenerationOptions(pattern=bound).pattern
                                                                     if name == "pattern" else bound)
        with pytest.raises(OptionError, match=f"^{name}|^pattern has"):
            GenerationOptions(**{name: past})


def test_a_kv_context_past_the_bound_is_refused_on_a_full_context_preset_too():
    # tiny's contexts are full: the video-length rule (recompute only) never saw it; a start frame would encode
    # 1 + (kv - 1) * 4 pixel frames from it
    with pytest.raises(OptionError) as e:
        GenerationOptions(kv_cache_frames=1_000_000).resolved(get_preset("tiny"))
    assert all(s in str(e.value) for s in ("kv_cache_frames 1000000", "[1, 1024]")), e.value


def test_a_pattern_iterator_is_read_no_further_than_the_bound():
    read = []
    decisions = (read.append(i) or i % 2 for i in range(10**6))  # no length: read until the bound is passed
    with pytest.raises(OptionError, match=f"pattern has more than {MAX_PATTERN} decisions"):
        GenerationOptions(pattern=decisions)
    assert len(read) == MAX_PATTERN + 1
    with pytest.raises(OptionError) as e:
        GenerationOptions(pattern={"0": 1})
    assert all(s in str(e.value) for s in ("pattern", "got dict")), e.value


NOT_OPTIONAL = [f.name for f in dataclasses.fields(GenerationOptions) if f.default is not None]


@pytest.mark.parametrize("name", NOT_OPTIONAL)
def test_none_is_refused_where_it_is_not_the_declared_default(name):
    with pytest.raises(OptionError) as exc:
        GenerationOptions(**{name: None})
    message = str(exc.value)
    assert message.startswith(f"{name} must be ") and "got None" in message, message
    assert f"leave {name} out for its default" in message, message


def test_none_stays_the_presets_value_where_that_is_declared():
    optional = {f.name for f in dataclasses.fields(GenerationOptions) if f.default is None}
    assert {"target_context", "drafter_cache", "kv_cache_frames", "num_blocks"} <= optional
    assert "mode" in NOT_OPTIONAL and FIELDS["mode"].default == "sdvg"
    with pytest.raises(OptionError) as e:
        DEFAULTS.replace(mode=None)
    assert all(s in str(e.value) for s in ("mode", "got None", "leave mode out")), e.value
    tiny = get_preset("tiny")
    assert GenerationOptions(target_context=None).resolved(tiny).target_context == tiny.target_context


def test_the_head_verifier_needs_its_file_where_the_options_meet_the_pipeline(tmp_path):
    tiny = get_preset("tiny")
    alone = GenerationOptions(exit_verifier="head")  # alone: the file may come with the server's or CLI's defaults
    with pytest.raises(OptionError) as e:
        alone.resolved(tiny)  # was accepted: the head verifier silently unused
    assert all(s in str(e.value) for s in ("exit_verifier 'head'", "exit_head=<path>", "--exit-head FILE")), e.value
    assert alone.replace(exit_head=str(tmp_path / "h.safetensors")).resolved(tiny).exit_verifier == "head"
    with pytest.raises(OptionError) as e:  # early exit on: refused at once
        GenerationOptions(mode="target", early_exit="target", exit_verifier="head")
    assert all(s in str(e.value) for s in ("exit_verifier 'head'", "--exit-head")), e.value
    with pytest.raises(OptionError, match=r"exit_head '.{60}'\.\.\. \(5000 characters\) is read by the head verifier"):
        GenerationOptions(exit_head="h" * 5000).resolved(tiny)  # the other half of the rule, quoted bounded


def test_deep_or_huge_client_values_are_refused_with_a_short_message():
    for changes in (dict(pattern=[_deep()]), dict(pattern=_deep()), dict(force_first_reject=_deep()),
                    dict(pattern=[b"1" * 10**6]), dict(exit_thresholds=_deep()), dict(mode=_deep()), dict(tau=_deep())):
        with pytest.raises(OptionError) as exc:  # not RecursionError from a repr
            GenerationOptions(**changes)
        assert len(str(exc.value)) < 400, str(exc.value)


# ------------------------------------------------------------------ as a live update calls it
@pytest.mark.parametrize("changes,match", [
    (dict(pattern="0" * 5000), "pattern has 5000 decisions; at most 1024"),
    (dict(pattern=""), r"pattern is empty: an update sets the pattern router's decisions"),
    (dict(pattern=[]), r"pattern is empty"),
    (dict(router=_deep()), r"unknown router \[\[\[\[\.\.\.\]\]\]\]; choose one of reward, random, pattern"),
    (dict(tau=_deep()), "tau must be a number"),
    (dict(tau=10**5000), r"tau is too large to be a number here"),
    (dict(seed=10**5000), "seed <an integer of about 5000 digits> must be an integer in"),
    (dict(prompt="a", interp_blocks=_deep()), "interp_blocks must be an integer, got"),
])
def test_a_live_update_is_checked_by_the_same_validators(changes, match):
    with pytest.raises(UpdateError, match=match) as exc:
        Update(**changes)
    assert len(str(exc.value)) < 400


def test_a_live_session_refuses_a_hostile_pattern_and_goes_on(tiny_pipe):
    session = tiny_pipe.session("a red fox", num_blocks=2, scheduler="reference", router="pattern", pattern="01")
    try:
        for bad in ("1" * 5000, "", [_deep()]):
            with pytest.raises(UpdateError):
                session.update(pattern=bad)
        assert session.update(pattern="11").block == 0  # the session took nothing of the refused ones
        assert session.stats["live"]["updates"] == [{"block": 0, "pattern": "11"}]
    finally:
        session.close()


def test_the_server_refuses_krea_kv_cache_num_frames_past_the_bound(tiny_pipe):
    from sdvg.serve.engine import Engine
    from sdvg.serve.protocol import ProtocolError, parse_params

    engine = Engine(tiny_pipe, max_steps=8, max_pixels=832 * 480)
    with pytest.raises(ProtocolError) as exc:  # tiny's full contexts accepted it before
        engine.spec(parse_params({"prompt": "x", "kv_cache_num_frames": 1_000_000}), 256, lambda _: False)
    assert exc.value.field == "kv_cache_num_frames" and "in [1, 1024]" in str(exc.value)
    for field, value in (("exit_eps", 1e308), ("exit_pattern_steps", 1e308), ("pattern", "0" * 5000)):
        with pytest.raises(ProtocolError) as exc:
            engine.spec(parse_params({"prompt": "x", field: value}), 256, lambda _: False)
        assert exc.value.field == field, (field, str(exc.value))
    with pytest.raises(ProtocolError) as exc:  # a server without --exit-head: the head verifier has no head
        engine.spec(parse_params({"prompt": "x", "exit_verifier": "head"}), 256, lambda _: False)
    assert exc.value.field == "exit_verifier" and "needs the learned head's file" in str(exc.value)


def test_a_prompt_schedule_file_is_read_as_every_config_is(tmp_path):
    """A schedule file goes through sdvg.bounded like a --config: YAML aliases, a FIFO, a 5000-deep JSON list and a
    missing file are UpdateErrors naming the file; a plain list reads."""
    import os

    from sdvg.live.updates import UpdateError, _read_schedule_file

    (tmp_path / "ok.yaml").write_text("- {block: 0, prompt: a fox}\n- {block: 2, prompt: a cat}\n")
    assert _read_schedule_file(tmp_path / "ok.yaml") == [{"block": 0, "prompt": "a fox"}, {"block": 2, "prompt": "a cat"}]
    (tmp_path / "bomb.yaml").write_text("a: &a [1, 1, 1, 1]\nb: &b [*a, *a, *a, *a]\nc: [*b, *b, *b]\n")
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    for name, why in (("bomb.yaml", "anchor"), ("fifo.yaml", "not a regular file"), ("deep.json", "deeper"),
                      ("none.yaml", "not found")):
        with pytest.raises(UpdateError, match=why):
            _read_schedule_file(tmp_path / name)
