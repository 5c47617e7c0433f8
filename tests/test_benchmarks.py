import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
def test_latency_benchmark_smoke(tmp_path):
    import latency

    res = latency.main(["--preset", "tiny", "--num-blocks", "3", "--repeats", "1", "--rates", "0,0.5,1.0",
                        "--variants", "reference", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"runs", "speedup_vs_target", "floor_ratio"} <= set(data)
    modes = [(r["mode"], r["scheduler"], r["acceptance"]) for r in data["runs"]]
    assert modes[:5] == [("target", "cpp", None), ("draft", "cpp", None), ("sdvg", "cpp", 0.0), ("sdvg", "cpp", 0.5),
                         ("sdvg", "cpp", 1.0)]
    assert [(m, s) for m, s, _ in modes[5:]] == [("target", "reference"), ("sdvg", "reference")]
    assert {v["scheduler"] for v in data["variants"]} == {"cpp", "reference"}
    for r in data["runs"]:
        assert {"mode", "backend", "scheduler", "acceptance", "wall_s", "stages", "floor_s"} <= set(r)
        assert r["wall_s"] > 0 and r["floor_s"] > 0
    # forced patterns are followed exactly
    assert data["runs"][4]["decisions"] == ["forced", "accepted", "accepted"]
    assert data["runs"][2]["decisions"] == ["forced", "rejected", "rejected"]
    # three labelled floors from per-block costs; target-made blocks cost what target-only paid at that index
    tgt = data["runs"][0]
    assert data["per_target_step_s"] == pytest.approx(tgt["stages"]["target"] / 12)
    for r in data["runs"]:
        f = r["floors"]
        assert f["target_side"] <= f["drafter_hidden"] <= f["sequential"], r["mode"]
        assert r["floor_placement"] == "sequential" and r["floor_s"] == f["sequential"]  # one device
    never = data["runs"][2]  # sdvg at 0%: every block made by the target
    assert never["floors"]["target_side"] == pytest.approx(tgt["floors"]["target_side"], rel=1e-9)
    always = data["runs"][4]  # 100%: the target makes block 0 only, and commits it once
    commits = [x for x in tgt["trace"] if x["stage"] == "target_commit"]
    mean_commit = sum(x["end_s"] - x["start_s"] for x in commits) / len(commits)
    assert sum(x["stage"] == "target_commit" for x in always["trace"]) == 1
    assert always["floors"]["target_side"] == pytest.approx(tgt["timeline"][0]["times"]["target"] + mean_commit,
                                                            rel=1e-6)
    assert set(data["floor_speedups_vs_target"]) == {"sequential", "drafter_hidden", "target_side"}
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == 7
    for png in ("timeline.png", "speedup.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speed-up" in (tmp_path / "results.md").read_text()
    assert res["speedup_vs_target"] == data["speedup_vs_target"]


@pytest.mark.slow
def test_latency_budget_keeps_what_was_measured(tmp_path):
    """With no time left, only target-only and SDVG at the rate nearest 73.1% run; the rest is listed as skipped."""
    import latency

    res = latency.main(["--preset", "tiny", "--num-blocks", "2", "--repeats", "1", "--rates", "0,1.0",
                        "--variants", "reference", "--budget-s", "0", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(r["mode"], r["scheduler"], r["acceptance"]) for r in data["runs"]] == [("target", "cpp", None),
                                                                                   ("sdvg", "cpp", 1.0)]
    # the measurement order: each variant (its SDVG run before its target-only run) before the rest
    assert data["skipped"] == ["sdvg@100.0% (eager, reference)", "target (eager, reference)", "draft (eager, cpp)",
                               "sdvg@0.0% (eager, cpp)"]
    assert data["speedup_vs_target"] == pytest.approx(data["runs"][0]["wall_s"] / data["runs"][1]["wall_s"])
    assert res["skipped"] == data["skipped"]
    assert "Not run (time budget)" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").exists()


@pytest.mark.slow
def test_stages_benchmark_writes_every_stage(tmp_path):
    import stages

    res = stages.main(["--preset", "tiny", "--repeats", "1", "--backends", "eager", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "stages.json").read_text())
    # one stage of each family at its steady-state shape (a cached DiT step, the 12-frame reward)
    assert list(data["stages"]) == ["drafter_dit_3f_cached", "target_dit_3f_cached", "vae_decode", "reward_12f"] \
        == list(res["stages"])
    assert all(row["eager_s"] > 0 and "compile_s" not in row for row in data["stages"].values())


@pytest.mark.slow
def test_host_syncs_benchmark_counts_before_and_after(tmp_path):
    import host_syncs

    res = host_syncs.main(["--preset", "tiny", "--num-blocks", "2", "--modes", "draft", "--repeats", "1",
                           "--variants", "eager,cuda_graphs,events", "--out", str(tmp_path)])
    before, after, events = (r["per_block"] for r in res["runs"])
    assert [r["variant"] for r in res["runs"]] == ["before (eager)", "after (cuda_graphs)",
                                                   "after (cuda_graphs, stage_timing events)"]
    # events: no per-stage wait left; the host reads (the guard's finite checks) stay
    assert after["stage_syncs"] > 0 and events.get("stage_syncs", 0) == 0
    assert events["scalar_reads"] == after["scalar_reads"]
    # the drafter's forwards (4 steps + the commit of block 0 over 2 blocks) each became one replay
    assert before.get("graph_replays", 0) == 0 and after["graph_replays"] == 4.5
    assert after["launches"] < before["launches"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"commit", "sdvg_C_build", "torch_cuda", "seed", "prompt", "tf32"} <= set(data["provenance"])
    assert "TF32" in (tmp_path / "results.md").read_text()
