"""The OpenMP wait policy `import sdvg` sets (sdvg/runtime.py) and what a run records about its host."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import os, sdvg.runtime as r; print(os.environ.get('OMP_WAIT_POLICY'), r._policy_before_torch)")


def _probe(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


@pytest.mark.parametrize("code,env,want", [
    (PROBE, {}, "PASSIVE True"),  # sdvg before torch: waiting OpenMP threads sleep
    (PROBE, {"OMP_WAIT_POLICY": "active"}, "active True"),  # the user's setting is kept
    # torch already loaded (a stand-in module, to spare the import): too late to change, nothing set
    ("import sys; sys.modules['torch'] = type(sys)('torch'); " + PROBE, {}, "None False"),
])
def test_import_sets_the_wait_policy_only_before_torch(code, env, want):
    assert _probe(code, **env) == want


def test_the_command_line_sets_it_before_torch():
    code = ("import sdvg.cli.main, os, sys, sdvg.runtime as r\n"  # the `sdvg` entry point's module
            "print(os.environ.get('OMP_WAIT_POLICY'), r._policy_before_torch, 'torch' in sys.modules)")
    assert _probe(code) == "PASSIVE True False"


def test_each_run_records_its_threads_and_load():
    from sdvg.generation.types import RunStats
    from sdvg.options import GenerationOptions
    from sdvg.runtime import host_state

    import torch

    host = RunStats("p", "tiny", GenerationOptions()).as_dict()["run"]["host"]
    assert set(host) == set(host_state()) == {"intra_op_threads", "inter_op_threads", "omp_num_threads",
                                               "omp_wait_policy", "cpu_count", "load_average_1m"}
    assert host["intra_op_threads"] == torch.get_num_threads() and host["cpu_count"] == os.cpu_count()
    assert host["load_average_1m"] is None or host["load_average_1m"] >= 0


@pytest.mark.parametrize("code,env,want", [
    ("import sdvg.runtime as r; print(r.waiters_spin())", {}, "False"),  # PASSIVE, as import sdvg sets it
    ("import sdvg.runtime as r; print(r.waiters_spin())", {"OMP_WAIT_POLICY": "active"}, "True"),
    # torch first with the variable unset: OpenMP's default (spin), whatever sdvg would set later
    ("import sys; sys.modules['torch'] = type(sys)('torch'); import sdvg.runtime as r; print(r.waiters_spin())",
     {}, "True"),
])
def test_waiters_spin_reads_the_policy_in_force(code, env, want):
    assert _probe(code, **env) == want


# A whole-video call on the scheduler's thread (as stream()) when OpenMP's waiters spin, on the calling thread when
# they sleep; the same video either way. Run in a fresh process: the policy is the process's.
WHERE = """
import threading, torch, sdvg
pipe = sdvg.SpeculativeVideoPipeline.from_preset("tiny")
pipe.set_progress_bar_config(disable=True)
started, start = [], threading.Thread.start
threading.Thread.start = lambda t: (started.append(t.name), start(t))[1]  # every thread the call starts, by name
out = pipe("a fox", num_blocks=2, seed=3, output_type="pt")
threading.Thread.start = start
ref = torch.cat([b.frames for b in pipe.stream("a fox", num_blocks=2, seed=3)])
print("sdvg-scheduler" in started, bool(torch.equal((out.frames[0].permute(0, 2, 3, 1) * 255).round().to(torch.uint8), ref)))
"""


@pytest.mark.parametrize("policy,threaded", [("ACTIVE", "True"), ("PASSIVE", "False")])
def test_a_whole_video_call_runs_where_the_policy_says(policy, threaded):
    assert _probe(WHERE, OMP_WAIT_POLICY=policy, HF_HUB_OFFLINE="1") == f"{threaded} True"
