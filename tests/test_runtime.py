"""The OpenMP wait policy `import sdvg` sets (sdvg/runtime.py) and what a run records about its host."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import os, sdvg.runtime as r; print(os.environ.get('OMP_WAIT_POLICY'), r.wait_policy_before_torch())")


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
            "print(os.environ.get('OMP_WAIT_POLICY'), r.wait_policy_before_torch(), 'torch' in sys.modules)")
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


# A pipeline built in a process whose OpenMP spins by default (torch imported first, the variable unset) parks one
# thread holding a second OpenMP team (sdvg/runtime.py: libgomp then spins each waiter briefly); sdvg first
# (PASSIVE) or an explicit policy: none. Whole-video calls run on the calling thread either way, the same video
# as stream(). Fresh processes: the policy is the process's.
SPARE = """
import threading, sys
if sys.argv[1] == "torch-first":
    import torch
import sdvg, torch
pipe = sdvg.SpeculativeVideoPipeline.from_preset("tiny")
pipe.set_progress_bar_config(disable=True)
started, start = [], threading.Thread.start
threading.Thread.start = lambda t: (started.append(t.name), start(t))[1]  # the threads the call starts, by name
out = pipe("a fox", num_blocks=2, seed=3, output_type="pt")
threading.Thread.start = start
ref = torch.cat([b.frames for b in pipe.stream("a fox", num_blocks=2, seed=3)])
same = torch.equal((out.frames[0].permute(0, 2, 3, 1) * 255).round().to(torch.uint8), ref)
held = [t.name for t in threading.enumerate() if t.name == "sdvg-openmp-team"]
print(len(held), "sdvg-scheduler" in started, same)
"""


@pytest.mark.parametrize("order,env,want", [
    ("torch-first", {}, "1 False True"),  # OpenMP's default: the spare team, the call on the calling thread
    # the user's explicit policy is kept; PASSIVE, as import sdvg sets it: a video each, so slow (the policies
    # themselves are checked without a video above)
    pytest.param("torch-first", {"OMP_WAIT_POLICY": "ACTIVE"}, "0 False True", marks=pytest.mark.slow),
    pytest.param("sdvg-first", {}, "0 False True", marks=pytest.mark.slow),
])
def test_a_spare_openmp_team_only_under_the_default_spin(order, env, want):
    out = subprocess.run([sys.executable, "-c", SPARE, order], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, "HF_HUB_OFFLINE": "1",
                              **env})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == want
