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

    host = RunStats("p", "tiny", GenerationOptions()).as_dict()["host"]
    assert set(host) == set(host_state()) == {"intra_op_threads", "inter_op_threads", "omp_num_threads",
                                               "omp_wait_policy", "cpu_count", "load_average_1m"}
    assert host["intra_op_threads"] == torch.get_num_threads() and host["cpu_count"] == os.cpu_count()
    assert host["load_average_1m"] is None or host["load_average_1m"] >= 0
