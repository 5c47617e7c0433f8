"""The statistics written by every path match docs/stats.md, for complete and interrupted runs."""
import json
import re
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parents[1] / "docs" / "stats.md").read_text(encoding="utf-8")
PROMPT = "a red fox"


def documented(section: str) -> dict[str, str]:
    """field -> meaning from the table under `## <section>`."""
    body = DOC.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9_]+)` \| [^|]+ \| (.+) \|$", body, re.M)}


TOP, BLOCK, TRACE = documented("Top-level fields"), documented("Block fields"), documented("Trace entries")
CLI_ONLY = {k for k, v in TOP.items() if v.startswith("CLI only")}
LIVE_ONLY = {k for k, v in TOP.items() if v.startswith("Live only")}
V2V_ONLY = {k for k, v in TOP.items() if v.startswith("Video-to-video only")}
START_ONLY = {k for k, v in TOP.items() if v.startswith("With a start frame only")}
OPTIONAL = {"input_ended"}  # written only when it happened


def _check(stats: dict, cli: bool = False):
    json.loads(json.dumps(stats, allow_nan=True))
    want = set(TOP) if cli else set(TOP) - CLI_ONLY
    if not stats.get("live"):
        want -= LIVE_ONLY
    if "input_video" not in stats:
        want -= V2V_ONLY
    if "start_frame" not in stats:
        want -= START_ONLY
    want -= OPTIONAL - set(stats)
    if cli and "prompt_index" not in stats:  # a prompts file's fields
        want -= {"prompt_index", "prompt_sha256"}
    assert set(stats) == want
    for b in stats["blocks"]:
        optional = {"emitted_scores"} if "emitted_scores" not in b else set()
        if not stats.get("live"):
            optional.add("live")
        if stats["early_exit"] == "none":
            optional |= {"mean_steps", "max_steps", "exit"}
        assert set(b) == set(BLOCK) - optional
        assert set(b["times"]) == {"draft", "decode", "score", "target", "drafter_commit", "target_commit", "commit"}
    for x in stats["trace"]:
        assert set(x) == set(TRACE)


@pytest.mark.parametrize("scheduler", ["cpp", "reference"])
def test_complete_run_matches_the_doc(tiny_pipe, scheduler):
    stats = tiny_pipe(PROMPT, num_blocks=2, scheduler=scheduler, score_emitted=True).stats.as_dict()
    _check(stats)
    assert stats["schema_version"] == 8 and stats["checkpoints"]["target"].startswith("random:tiny")


@pytest.mark.parametrize("scheduler", ["cpp", "reference"])
def test_early_exit_run_matches_the_doc(tiny_pipe, scheduler):
    stats = tiny_pipe(PROMPT, num_blocks=3, scheduler=scheduler, early_exit="both", exit_verifier="pattern",
                      pattern="01", router="pattern").stats.as_dict()
    _check(stats)
    assert 1.0 <= stats["mean_steps"] < 4.0 and stats["max_steps"] <= 4
    assert set(stats["exit_roles"]) == {"drafter", "target"}
    for b in stats["blocks"]:
        assert b["exit"]["producer"] == ("drafter" if b["decision"] == "accepted" else "target")
        assert abs(sum(b["exit"][b["exit"]["producer"]]["exit_fractions"]) - 1.0) < 1e-9


def test_interrupted_run_has_the_same_fields(tiny_pipe):
    stream = tiny_pipe.stream(PROMPT, num_blocks=3)
    next(stream)
    stream.close()
    stats = stream.stats.as_dict()
    _check(stats)
    assert stats["interrupted"] is True and stats["blocks_done"] == 1 and stats["wall_s"] > 0
    with pytest.raises(StopIteration):
        next(stream)  # a closed stream stays closed; its stats stay as they were
    assert stream.stats.as_dict()["wall_s"] == stats["wall_s"]


def test_cli_file_is_strict_json_and_documented(tmp_path):
    from sdvg import cli

    assert cli.main(["generate", "--prompt", PROMPT, "--num-blocks", "2", "--tau=-inf", "--quiet",
                     "--out", str(tmp_path / "v.mp4"), "--stats", str(tmp_path / "s.json")]) == 0
    text = (tmp_path / "s.json").read_text()
    stats = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    _check(stats, cli=True)
    assert stats["tau"] is None and stats["nonfinite_fields"] == ["tau"]


def test_live_session_matches_the_doc(tiny_pipe):
    session = tiny_pipe.session(PROMPT, num_blocks=2, scheduler="reference")
    next(session)
    session.update(prompt="an owl", interp_blocks=1)
    list(session)
    stats = session.stats.as_dict()
    _check(stats)
    assert stats["updates"] == [{"block": 1, "prompt": "an owl", "interp_blocks": 1}]
    assert set(stats["blocks"][1]["live"]) == {"block", "segment", "prompt_index", "blend_weight", "forced_by_update",
                                                 "recache_forwards"}


def test_video_to_video_runs_match_the_doc(tiny_pipe):
    import numpy as np

    frames = np.random.default_rng(0).integers(0, 256, size=(21, 40, 48, 3), dtype=np.uint8)
    stats = tiny_pipe(PROMPT, num_blocks=2, scheduler="reference", input_video=frames, strength=0.7).stats[0].as_dict()
    _check(stats)
    assert stats["strength"] == 0.7 and stats["input_video"] == {"source": "frames", "frames": 21, "height": 40,
                                                                 "width": 48}
    session = tiny_pipe.session(PROMPT, num_blocks=2, scheduler="reference", input_frames=True, input_timeout_s=0.2)
    session.update(input_frames=frames[:9])
    assert len(list(session)) == 1
    stats = session.stats.as_dict()
    _check(stats)
    assert "did not arrive" in stats["input_ended"] and stats["input_video"]["source"] == "live"
