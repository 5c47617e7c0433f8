"""The statistics written by every path match docs/stats.md (schema 9: grouped), for complete, interrupted, live,
CLI, video-to-video and start-frame runs; `read_stats` reads the flat schemas 1-8 as 9."""
import json
import re
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parents[1] / "docs" / "stats.md").read_text(encoding="utf-8")
PROMPT = "a red fox"
GROUPS = ("run", "video", "options", "result", "live", "cli")


def documented(section: str) -> dict[str, str]:
    """field -> meaning from the table under `## <section>` (the heading's first words)."""
    body = DOC.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9_]+)` \| [^|]+ \| (.+) \|$", body, re.M)}


TOP, BLOCK, TRACE = documented("Top-level fields"), documented("Block fields"), documented("Trace entries")
GROUP = {g: documented(f"`{g}`") for g in GROUPS}
V2V_ONLY = {k for k, v in GROUP["video"].items() if v.startswith("Video-to-video only")}
START_ONLY = {k for k, v in GROUP["video"].items() if v.startswith("With a start frame only")}
OPTIONAL = {"input_ended"}  # written only when it happened


def _check(stats: dict, cli: bool = False, live: bool = False):
    json.loads(json.dumps(stats, allow_nan=True))
    assert stats["schema_version"] == 10
    want = set(TOP) - ({"cli"} if not cli else set()) - ({"live"} if not live else set())
    assert set(stats) == want
    for group in GROUPS:
        if group not in stats:
            continue
        want = set(GROUP[group])
        if group == "video":
            if "input_video" not in stats["video"]:
                want -= V2V_ONLY
            if "start_frame" not in stats["video"]:
                want -= START_ONLY
        if group == "live":
            want -= OPTIONAL - set(stats["live"])
        if group == "cli" and "prompt_index" not in stats["cli"]:  # a prompts file's fields
            want -= {"prompt_index", "prompt_sha256"}
        assert set(stats[group]) == want, group
    from sdvg.options import GenerationOptions

    assert list(stats["options"]) == list(GenerationOptions().as_dict())
    for b in stats["blocks"]:
        optional = {"emitted_scores"} if "emitted_scores" not in b else set()
        if not live:
            optional.add("live")
        if stats["options"]["early_exit"] == "none":
            optional |= {"mean_steps", "max_steps", "exit"}
        assert set(b) == set(BLOCK) - optional
        assert set(b["times"]) == {"draft", "decode", "score", "target", "drafter_commit", "target_commit", "recache",
                                   "commit"}
    for x in stats["trace"]:
        assert set(x) == set(TRACE)


def test_every_field_has_one_group_and_the_doc_lists_each_group_in_the_code_s_order():
    from sdvg.generation.types import FIELDS

    for group in GROUPS:
        assert list(GROUP[group]) == [name for g, name in FIELDS.values() if g == group and name], group
    assert [name for g, name in FIELDS.values() if not g] == ["schema_version", "blocks", "trace", "nonfinite_fields"]


@pytest.mark.parametrize("scheduler", ["cpp", "reference"])
def test_complete_run_matches_the_doc(tiny_pipe, scheduler):
    stats = tiny_pipe(PROMPT, num_blocks=2, scheduler=scheduler, score_emitted=True).stats.as_dict()
    _check(stats)
    run, video = stats["run"], stats["video"]
    assert run["checkpoints"]["target"].startswith("random:tiny") and run["argv"] is None and run["load_s"] > 0
    assert run["started_at"].endswith("Z") and run["hostname"] and run["preset"] == "tiny"
    assert (video["height"], video["width"], video["fps"], video["frames"]) == (64, 64, 16, 21)
    assert stats["result"]["wall_s"] > 0 and stats["options"]["scheduler"] == scheduler


# slow: the reference loop's case; its stats stay fast in test_complete_run_matches_the_doc[reference], an early-exit
# run's in [cpp] here
@pytest.mark.parametrize("scheduler", ["cpp", pytest.param("reference", marks=pytest.mark.slow)])
def test_early_exit_run_matches_the_doc(tiny_pipe, scheduler):
    stats = tiny_pipe(PROMPT, num_blocks=3, scheduler=scheduler, early_exit="both", exit_verifier="pattern",
                      pattern="01", router="pattern").stats.as_dict()
    _check(stats)
    assert 1.0 <= stats["result"]["mean_steps"] < 4.0 and stats["result"]["max_steps"] <= 4
    assert set(stats["result"]["exit_roles"]) == {"drafter", "target"}
    for b in stats["blocks"]:
        assert b["exit"]["producer"] == ("drafter" if b["decision"] == "accepted" else "target")
        assert abs(sum(b["exit"][b["exit"]["producer"]]["exit_fractions"]) - 1.0) < 1e-9


def test_interrupted_run_has_the_same_fields(tiny_pipe):
    stream = tiny_pipe.stream(PROMPT, num_blocks=3)
    next(stream)
    stream.close()
    stats = stream.stats.as_dict()
    _check(stats)
    assert stats["video"]["interrupted"] is True
    assert stats["video"]["blocks_done"] == 1 and stats["result"]["wall_s"] > 0
    with pytest.raises(StopIteration):
        next(stream)  # a closed stream stays closed; its stats stay as they were
    assert stream.stats.as_dict()["result"]["wall_s"] == stats["result"]["wall_s"]


def test_cli_file_is_strict_json_and_documented(tmp_path):
    from sdvg import cli

    assert cli.main(["generate", "--prompt", PROMPT, "--num-blocks", "2", "--tau=-inf", "--quiet",
                     "--out", str(tmp_path / "v.mp4"), "--stats", str(tmp_path / "s.json")]) == 0
    text = (tmp_path / "s.json").read_text()
    stats = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    _check(stats, cli=True)
    assert stats["options"]["tau"] is None and stats["nonfinite_fields"] == ["options.tau"]
    assert stats["cli"]["infinite_options"] == {"tau": "-inf"} and stats["cli"]["video_path"] == str(tmp_path / "v.mp4")
    assert stats["run"]["argv"][0] == "sdvg" and stats["run"]["argv"][1:4] == ["generate", "--prompt", PROMPT]


def test_live_session_matches_the_doc(tiny_pipe):
    session = tiny_pipe.session(PROMPT, num_blocks=2, scheduler="reference")
    next(session)
    session.update(prompt="an owl", interp_blocks=1)
    list(session)
    stats = session.stats.as_dict()
    _check(stats, live=True)
    assert stats["live"]["updates"] == [{"block": 1, "prompt": "an owl", "interp_blocks": 1}]
    assert set(stats["blocks"][1]["live"]) == {"block", "segment", "prompt_index", "blend_weight", "forced_by_update",
                                                 "recache_forwards"}


def test_video_to_video_runs_match_the_doc(tiny_pipe):
    import numpy as np

    frames = np.random.default_rng(0).integers(0, 256, size=(21, 40, 48, 3), dtype=np.uint8)
    stats = tiny_pipe(PROMPT, num_blocks=2, scheduler="reference", input_video=frames, strength=0.7).stats[0].as_dict()
    _check(stats)
    assert stats["options"]["strength"] == 0.7 and stats["video"]["input_video"] == {"source": "frames", "frames": 21, "height": 40,
                                                                 "width": 48}
    session = tiny_pipe.session(PROMPT, num_blocks=2, scheduler="reference", input_frames=True, input_timeout_s=0.2)
    session.update(input_frames=frames[:9])
    assert len(list(session)) == 1
    stats = session.stats.as_dict()
    _check(stats, live=True)
    assert "did not arrive" in stats["live"]["input_ended"] and stats["video"]["input_video"]["source"] == "live"


def test_start_frame_runs_match_the_doc(tiny_pipe):
    import numpy as np

    image = np.random.default_rng(1).integers(0, 256, size=(40, 48, 3), dtype=np.uint8)
    stats = tiny_pipe(PROMPT, num_blocks=2, scheduler="reference", start_frame=image).stats.as_dict()
    _check(stats)
    assert stats["video"]["start_frame"]["source"] == "pixels" and stats["video"]["start_frame"]["height"] == 40
    session = tiny_pipe.session(PROMPT, num_blocks=1, scheduler="reference", start_frame=image)
    list(session)
    stats = session.stats.as_dict()
    _check(stats, live=True)
    assert "source" not in stats["video"]["start_frame"]


# ----------------------------------------------------------------------------- reading older records
DATA = Path(__file__).resolve().parent / "data"
# Written by sdvg at schema 8 (the flat record): `sdvg generate --preset tiny --prompts-file <a red fox / an owl at
# night> --limit 1 --num-blocks 1 --tau=-inf`, and a 2-block live session with one prompt update.
FLAT_CLI = json.loads((DATA / "stats_schema8.jsonl").read_text().splitlines()[0])
FLAT_LIVE = json.loads((DATA / "stats_schema8_live.json").read_text())


def flattened(record: dict, version: int) -> dict:
    """A schema-9 record written flat, as schemas 1-8 were (the fields 9 added dropped)."""
    from sdvg.generation.types import FIELDS, NEW_IN_9

    place = {v: k for k, v in FIELDS.items()}
    flat = {"schema_version": version}
    for group in GROUPS:
        if group == "live" and group in record:
            flat["live"] = True
        for name, value in record.get(group, {}).items():
            if place[(group, name)] not in NEW_IN_9:
                flat[place[(group, name)]] = value
    flat.update(blocks=record["blocks"], trace=record["trace"],
                nonfinite_fields=[p.split(".", 1)[1] if p.split(".", 1)[0] in GROUPS else p
                                  for p in record["nonfinite_fields"]])
    return flat


@pytest.mark.parametrize("flat", [FLAT_CLI, FLAT_LIVE], ids=["cli", "live"])
def test_a_schema_8_record_reads_as_10_with_every_value_in_its_group(flat):
    import sdvg
    from sdvg.generation.types import FIELDS, NEW_IN_9

    assert flat["schema_version"] == 8
    rec = sdvg.read_stats(flat)
    _check(rec, cli="prompt_index" in flat, live=bool(flat.get("live")))
    # schema 10's re-cache time: 0.0 where the older schema had none
    assert all(b["times"].pop("recache") == 0.0 for b in rec["blocks"])
    assert rec["result"]["stage_totals"].pop("recache") == 0.0
    for key, value in flat.items():
        group, name = FIELDS[key]
        if key == "schema_version" or key == "nonfinite_fields" or (group == "live" and not name):
            continue
        assert (rec[group][name] if group else rec[name]) == value, key
    for key in NEW_IN_9:
        group, name = FIELDS[key]
        assert rec[group][name] is None
    assert rec["nonfinite_fields"] == [("options." if p == "tau" else "") + p for p in flat["nonfinite_fields"]]
    if "prompt_index" in flat:
        assert rec["options"]["tau"] is None and rec["nonfinite_fields"] == ["options.tau"]
        assert rec["cli"]["video_path"] == flat["video"] and rec["video"]["prompt"] == "a red fox"
    else:
        assert rec["live"]["updates"] == [{"block": 1, "prompt": "an owl", "interp_blocks": 1}]


def test_a_flat_record_round_trips_to_the_same_grouped_values(tiny_pipe, tmp_path):
    import sdvg
    from sdvg.generation.types import FIELDS, NEW_IN_9

    record = tiny_pipe(PROMPT, num_blocks=2, tau=float("inf"), scheduler="reference").stats.as_dict()
    assert sdvg.read_stats(record) == record  # the current schema as it is
    for version in range(1, 9):
        back = sdvg.read_stats(flattened(record, version))
        for key in NEW_IN_9:
            group, name = FIELDS[key]
            assert back[group].pop(name) is None
        assert back == {**record, **{g: {k: v for k, v in record[g].items() if (g, k) not in
                                         {FIELDS[n] for n in NEW_IN_9}} for g in ("run", "video")}}
        assert back["nonfinite_fields"] == ["options.tau"]
    path = tmp_path / "s.json"
    path.write_text(tiny_pipe(PROMPT, num_blocks=1, scheduler="reference").stats.to_json())
    assert sdvg.read_stats(path)["video"]["frames"] == 9 and sdvg.read_stats(str(path))["schema_version"] == 10


def test_a_schema_9_record_reads_with_no_recache_time(tiny_pipe):
    """Schema 10 times a re-cache as its own stage: a schema-9 record (the same groups, no `recache` time) reads
    with `recache` 0.0 in every block's times and in the stage totals, the caller's record left as it was."""
    import copy

    import sdvg

    record = tiny_pipe(PROMPT, num_blocks=2, scheduler="reference").stats.as_dict()
    old = copy.deepcopy(record)
    old["schema_version"] = 9
    for times in [b["times"] for b in old["blocks"]] + [old["result"]["stage_totals"]]:
        del times["recache"]
    kept = copy.deepcopy(old)
    back = sdvg.read_stats(old)
    assert old == kept  # not changed in place
    assert back["schema_version"] == 10 and all(b["times"]["recache"] == 0.0 for b in back["blocks"])
    assert back == {**record, "blocks": back["blocks"]} and back["result"]["stage_totals"]["recache"] == 0.0


@pytest.mark.parametrize("record,match", [
    ({"schema_version": 11, "run": {}}, r"schema 11 is newer than this sdvg reads \(1-10\): upgrade sdvg"),
    ({"prompt": "a fox", "tau": 0.1}, "no integer schema_version"),
    ({"schema_version": "8"}, "no integer schema_version"),
    ({"schema_version": 0}, "schema 0 does not exist"),
    ({"schema_version": 8, "not_a_field": 1}, "not_a_field have no group"),
    ([1, 2], "a statistics record is a JSON object"),
])
def test_a_record_of_no_or_a_newer_schema_is_refused_naming_the_fix(record, match):
    import sdvg

    with pytest.raises(ValueError, match=match):
        sdvg.read_stats(record)


def test_resume_reads_a_schema_8_file(tmp_path):
    """--resume over a JSON Lines file an sdvg of schema 8 began: its record counts (that prompt is skipped), the
    next prompt's record is appended in schema 9; the same file with other options is refused naming them."""
    from sdvg import cli

    (tmp_path / "p.txt").write_text("a red fox\nan owl at night\n")
    stats = tmp_path / "s.jsonl"
    stats.write_text((DATA / "stats_schema8.jsonl").read_text())

    def resume(*flags):
        return cli.main(["generate", "--preset", "tiny", "--prompts-file", str(tmp_path / "p.txt"), "--num-blocks",
                         "1", "--quiet", "--out", str(tmp_path / "v.mp4"), "--stats", str(stats), "--resume", *flags])

    assert resume("--tau=inf") == 2  # +inf vs the record's -inf (its cli.infinite_options): refused
    assert resume("--tau=-inf") == 0
    lines = [json.loads(x) for x in stats.read_text().splitlines()]
    assert [x["schema_version"] for x in lines] == [8, 10] and lines[0] == FLAT_CLI
    assert lines[1]["cli"]["prompt_index"] == 1 and lines[1]["video"]["prompt"] == "an owl at night"
    assert not (tmp_path / "v_0000.mp4").exists() and (tmp_path / "v_0001.mp4").exists()
    assert resume("--tau=-inf", "--seed", "5") == 2  # other options: refused
