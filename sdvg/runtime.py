"""The process's CPU threading, as sdvg sets it and as each run records it (`stats["run"]["host"]`).

OpenMP (torch's CPU thread pool) spins by default: a thread waiting at the end of a parallel region
keeps its core busy for a while. On a machine where other processes want the cores, those spinning
waiters and the work they wait for take turns on the cores, and a video of many small operators ran
3-12x slower on the calling thread (benchmarks/busy_machine.py). `OMP_WAIT_POLICY=PASSIVE` makes the
waiters sleep instead; on a quiet machine it measured the same. OpenMP reads the variable once, when
torch is first imported, so `import sdvg` sets it (unless it is already set, which is respected) only
when torch is not imported yet; `sdvg` on the command line always imports it first. Departure: this
changes a default of the process that imports sdvg; set `OMP_WAIT_POLICY=ACTIVE` to keep OpenMP's."""
from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
# Set by `claim_wait_policy()` (sdvg/__init__.py): whether the policy was in place before torch loaded OpenMP.
_policy_before_torch: bool | None = None


def claim_wait_policy() -> None:
    """Called by `import sdvg`, before anything imports torch: OMP_WAIT_POLICY=PASSIVE unless set."""
    global _policy_before_torch
    if _policy_before_torch is not None:
        return
    torch_loaded = "torch" in sys.modules
    if not torch_loaded:
        os.environ.setdefault(WAIT_POLICY, "PASSIVE")
    _policy_before_torch = not torch_loaded or WAIT_POLICY in os.environ


def waiters_spin() -> bool:
    """Whether OpenMP's waiting threads spin in this process: its default (torch imported before sdvg with
    OMP_WAIT_POLICY unset) or OMP_WAIT_POLICY=ACTIVE; False under PASSIVE.

    Why it decides where a whole-video call runs (sdvg/pipeline.py): libgomp (torch's OpenMP on Linux) spins
    a waiter for about 300,000 iterations while the process's OpenMP threads fit the cores, but only about
    1,000 once they outnumber the cores. A video on the main thread alone keeps one team (fits the cores):
    its waiters spin, and beside other processes they take turns on the cores with the work they wait for
    (a 3-block `tiny` video 2.5x slower than `stream()`, benchmarks/busy_machine.py). `stream()`'s scheduler
    thread brings a second team, so its waiters throttle. The policy cannot be changed once torch has
    loaded OpenMP (libgomp reads it once and exports no setter), so a whole-video call runs on the same kind
    of scheduler thread as `stream()` whenever waiters spin, and on the calling thread when they sleep."""
    if _policy_before_torch is False:  # torch first, the variable unset then: OpenMP's default
        return True
    return os.environ.get(WAIT_POLICY, "").upper() != "PASSIVE"


def thread_settings() -> dict:
    """torch's intra-op and inter-op threads, the OpenMP variables, the wait policy in force, the cores."""
    import torch

    policy = os.environ.get(WAIT_POLICY)
    return {"intra_op_threads": torch.get_num_threads(), "inter_op_threads": torch.get_num_interop_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            # the policy OpenMP runs with: the variable's value if it was set before torch was imported
            "omp_wait_policy": (policy.upper() if policy else "default (spin)") if _policy_before_torch
            else "default (spin): torch was imported before sdvg with OMP_WAIT_POLICY unset",
            "cpu_count": os.cpu_count()}


def host_state() -> dict:
    """What a run records about the machine it ran on: thread settings and the 1-minute load average."""
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:  # not on every platform
        load = None
    return {**thread_settings(), "load_average_1m": load}
