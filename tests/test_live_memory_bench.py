"""benchmarks/live_memory.py: its verdict on synthetic series, and a short real run (12 blocks)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import live_memory  # noqa: E402


def _rows(n=30, rss=lambda b: 800.0, kv=lambda b: 4096, tensors=lambda b: 500,
          visible=lambda b: min(3 * (b + 1), 9)):
    """Per-block rows as the benchmark records them: a windowed drafter (its window fills at block 2) and a
    recompute target (its visible frames change from block to block)."""
    return [{"block": b, "decision": "accepted", "rss_mib": rss(b), "kv_bytes": 2 * kv(b),
             "kv": {"drafter": {"context": "full", "bytes": kv(b), "visible_frames": visible(b),
                                "committed_frames": 3 * b},
                    "target": {"context": "recompute", "bytes": kv(b), "visible_frames": 6 if b % 2 else 3,
                               "committed_frames": 3 * b}},
             "tensors": tensors(b), "tensor_bytes": 1000 * tensors(b), "objects": 10_000 + 20 * b,
             "stats_blocks": b + 1, "trace_spans": 4 * (b + 1), "block_times": b + 1, "pending_target_commits": 0}
            for b in range(n)]


def test_summary_decides_flat_and_not_flat():
    flat = live_memory.summarize(_rows(), warm=10, tolerance=0.05)
    assert flat["flat"] and flat["reasons"] == []
    assert flat["window_filled_block"] == 2 and flat["baseline_block"] == 10 and flat["last_block"] == 29
    assert flat["kv"]["drafter"]["bytes"] == [4096] and flat["kv_bytes"]["max_minus_min"] == 0
    assert flat["objects"]["slope_per_block"] == pytest.approx(20.0)  # reported, not judged
    assert flat["bookkeeping"]["trace_spans"]["per_block"] == pytest.approx(4.0)
    # the window fills after warm: the baseline moves there
    late = live_memory.summarize(_rows(visible=lambda b: min(b + 1, 15)), warm=10, tolerance=0.05)
    assert late["window_filled_block"] == 14 and late["baseline_block"] == 14 and late["flat"]
    # a recompute role's visible frames may change from block to block; a windowed one's may not
    unsettled = live_memory.summarize(_rows(visible=lambda b: 9 if b % 2 else 6), warm=10, tolerance=0.05)
    assert unsettled["reasons"] == ["a windowed cache's visible frames never stopped changing"]
    changed = live_memory.summarize(_rows(visible=lambda b: 9 if b != 20 else 6), warm=10, tolerance=0.05)
    assert changed["baseline_block"] == 21 and changed["flat"]  # settled again after block 20

    rss = live_memory.summarize(_rows(rss=lambda b: 800.0 + 3 * b), warm=10, tolerance=0.05)
    assert not rss["flat"] and any(r.startswith("RSS grew") for r in rss["reasons"])
    # the largest RSS counts, not only the last
    spike = live_memory.summarize(_rows(rss=lambda b: 900.0 if b == 20 else 800.0), warm=10, tolerance=0.05)
    assert not spike["flat"]
    kv = live_memory.summarize(_rows(kv=lambda b: 4096 if b < 25 else 8192), warm=10, tolerance=0.05)
    assert not kv["flat"] and "drafter KV bytes not constant: [4096, 8192]" in kv["reasons"]
    # a slow rise within the tolerance is still growth: the last third's peak beats the first third's
    creep = live_memory.summarize(_rows(tensors=lambda b: 500 + b), warm=10, tolerance=0.05)
    assert not creep["flat"] and any("still rising" in r for r in creep["reasons"])
    # a bounded oscillation (a cache refilled every few blocks) is flat
    assert live_memory.summarize(_rows(tensors=lambda b: 500 + b % 4), warm=10, tolerance=0.05)["flat"]
    assert live_memory.summarize(_rows(n=11), warm=10, tolerance=0.05)["flat"] is False  # one block: no verdict


@pytest.mark.slow
def test_live_memory_benchmark_small_run(tmp_path):
    # lazy target commits with every block accepted (no update forces the target): an unbounded session holds at most
    # MAX_HELD_COMMITS of them (committed oldest first past that); made at once none are held
    rc = live_memory.main(["--blocks", "12", "--warm", "6", "--out", str(tmp_path),
                           "--configs", "recompute-no-updates,recompute-no-updates-eager"])
    data = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and data["flat"] is True, [c["summary"]["reasons"] for c in data["configs"]]
    assert data["command"].startswith("python benchmarks/live_memory.py --blocks 12")
    assert {"date", "torch", "commit"} <= set(data["provenance"])
    lazy, eager = data["configs"]
    assert [c["config"] for c in data["configs"]] == ["recompute-no-updates", "recompute-no-updates-eager"]
    for c in data["configs"]:
        assert [r["block"] for r in c["blocks"]] == list(range(12)) and c["blocks_run"] == 12
        for role in ("drafter", "target"):  # each role's KV buffer: one allocation, the same bytes at every block
            assert len({r["kv"][role]["bytes"] for r in c["blocks"]}) == 1
        assert c["summary"]["kv_bytes"]["max_minus_min"] == 0
        assert c["summary"]["baseline_block"] == 6 and c["updates"] == 0
    # (a windowed full context fills its RoPE tables (an LRU of 64) and kept clean frames over tens of blocks: the
    # 300-block run covers it, results/live-memory-tiny)
    assert lazy["horizon"] is None and eager["horizon"] is None  # recompute: no RoPE bound
    from sdvg.live.session import MAX_HELD_COMMITS

    assert [r["pending_target_commits"] for r in lazy["blocks"]] == [min(b, MAX_HELD_COMMITS) for b in range(12)]
    assert lazy["summary"]["flat"], lazy["summary"]["reasons"]
    assert {r["pending_target_commits"] for r in eager["blocks"]} == {0}
    assert eager["summary"]["flat"], eager["summary"]["reasons"]
    assert eager["summary"]["tensors"]["max_minus_min"] == 0
    md = (tmp_path / "summary.md").read_text()
    assert "| recompute-no-updates | 12 | 6 |" in md and "| recompute-no-updates-eager | 12 | 6 |" in md
    assert "Verdict: flat (2 of 2 configs flat)" in md
