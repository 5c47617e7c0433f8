"""The process's CPU threading, as sdvg sets it and as each run records it (`stats["run"]["host"]`).

OpenMP (torch's CPU thread pool) spins by default: a thread waiting at the end of a parallel region
keeps its core busy for a while. On a machine where other processes want the cores, those spinning
waiters and the work they wait for take turns on the cores, and a video of many small operators ran
3-12x slower on the calling thread (benchmarks/busy_machine.py). `OMP_WAIT_POLICY=PASSIVE` makes the
waiters sleep instead. OpenMP reads the variable once, when torch is first imported, so `import sdvg`
sets it (unless it is already set, which is respected) only when torch is not imported yet; `sdvg` on
the command line always imports it first. A process that imported torch first gets the same effect from
`hold_spare_team` (below). Departure: this changes a default of the process that imports sdvg, and it
costs a quiet CPU-only machine time on videos of many small operators (a 9-block draft-only `cpu-bench`
video: 4.1-4.7 s against 2.9-3.3 s spinning, 2 cores; benchmarks/README.md, "A busy machine"); set
`OMP_WAIT_POLICY=ACTIVE` before Python starts to keep OpenMP's spinning."""
from __future__ import annotations

import os
import sys
import threading

WAIT_POLICY = "OMP_WAIT_POLICY"
# Set by `claim_wait_policy()` (sdvg/__init__.py): whether the policy was in place before torch loaded OpenMP.
_policy_before_torch: bool | None = None
_spare_team = None  # the parked thread of `hold_spare_team`
_spare_lock = threading.Lock()


def claim_wait_policy() -> None:
    """Called by `import sdvg`, before anything imports torch: OMP_WAIT_POLICY=PASSIVE unless set."""
    global _policy_before_torch
    if _policy_before_torch is not None:
        return
    torch_loaded = "torch" in sys.modules
    if not torch_loaded:
        os.environ.setdefault(WAIT_POLICY, "PASSIVE")
    _policy_before_torch = not torch_loaded or WAIT_POLICY in os.environ


def wait_policy_before_torch() -> bool | None:
    """Whether OpenMP's wait policy was in place before torch loaded OpenMP (sdvg set PASSIVE first, or the user
    set OMP_WAIT_POLICY): what `host_state` reports; None before `claim_wait_policy` (`import sdvg`) ran."""
    return _policy_before_torch


def hold_spare_team() -> bool:
    """When torch was imported before sdvg with OMP_WAIT_POLICY unset (OpenMP's default policy: waiters
    spin), park one thread that holds an OpenMP team of its own, once per process; True when it is held.

    Why: libgomp (torch's OpenMP on Linux) spins a waiter for about 300,000 iterations while the process's
    OpenMP threads fit the cores, and only about 1,000 once they outnumber them. A video on the calling
    thread alone keeps one team, which fits: its waiters spin, and beside other processes they take turns
    on the cores with the work they wait for (a 3-block `tiny` whole-video call 2.5x slower than `stream()`
    under load, benchmarks/busy_machine.py; `stream()`'s scheduler thread brought a second team). The
    policy cannot change once torch has loaded OpenMP (libgomp reads it once and exports no setter), so a
    second team, asleep on a parked daemon thread, makes the process's OpenMP threads outnumber the cores
    and every waiter's spin short, wherever the video runs: on the calling thread, where thread-local state
    (grad mode, dispatch modes, profilers) applies as the caller set it. Cost: the parked thread and its
    team's workers, asleep. An explicit OMP_WAIT_POLICY (ACTIVE included) is the user's, and is kept."""
    global _spare_team
    if _policy_before_torch is not False:  # sdvg came first (PASSIVE), or the user set the policy
        return False
    with _spare_lock:
        if _spare_team is None:
            import torch

            ready = threading.Event()

            def hold() -> None:
                torch.ones(1 << 20).sum()  # one parallel region: this thread's team is made and kept
                ready.set()
                threading.Event().wait()  # parked for the life of the process

            _spare_team = threading.Thread(target=hold, name="sdvg-openmp-team", daemon=True)
            _spare_team.start()
            ready.wait()
    return True


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
