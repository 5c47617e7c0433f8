"""The native scheduler's driver: the SDVG loop run by `sdvg._C.Scheduler` (`scheduler="cpp"`).

The scheduler decides, orders and times everything, owns the KV-cache pointer moves and runs the
drafter ahead on its own thread when asked (`run_ahead`); Python is entered only for the stage
calls of `calls.StageCalls` (a subclass of the typed boundary `sdvg._C.StageCalls`), the very object
the reference loop calls, so the outputs are identical. Blocks come back through a queue as soon as
the scheduler emits them. The scheduler rejects a non-finite draft on its NaN score, and a
non-finite target or emitted output raises from the stage call (`StageGuard`).

The scheduler asks `StageCalls.plan(b)` before each block (the video's plan, sdvg/generation/plan.py:
a whole video's `FixedPlan` or a live session's `begin`, once per block, from the thread that reaches
it first) and the video ends at the first block planned `stop`. A live session runs with `config.live`
(no block count). Its blocks wait in a short
queue for the consumer (`LIVE_QUEUED_BLOCKS`), so a session that is not read does not run on.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

from sdvg._native import _C
from sdvg.generation.calls import StageCalls
from sdvg.generation.plan import FixedPlan
from sdvg.generation.prepare import prepare
from sdvg.generation.types import BlockRecord, Counters, LoopReport
from sdvg.models.components import Components
from sdvg.options import GenerationOptions

_DONE = object()
LIVE_QUEUED_BLOCKS = 1  # a live session's emitted blocks waiting for the consumer (the scheduler then waits)


def scheduler_config(opts: GenerationOptions, frames_per_block: int, drafter_steps: int,
                     drafter_recompute: bool = False, target_recompute: bool = False, live: bool = False,
                     max_held_target_commits: int = 0, record_blocks: int = 0, prefix_frames: int = 0):
    """The native scheduler's config: every field by name (the C++ side has no defaults and refuses an
    unknown or missing field). `drafter_steps`: the drafter's model calls per denoise (counted as skipped
    when block 0's draft is not made); `*_recompute`: the role's context is rebuilt before each block
    (its commits only record latents, no pointer moves); `live`: an unbounded video, stopped by its plan
    alone (no block count; every video is planned block by block through `StageCalls.plan`); `max_held_target_commits`: lazy target commits held at most
    (0: no cap); `record_blocks`: the scheduler keeps the records and trace spans of the last N emitted blocks
    (a live session's `record_blocks`; 0: all); `prefix_frames`: a start frame's latent frames before block 0 (a
    rollback to block b goes to frame prefix_frames + b * frames_per_block)."""
    return _C.SchedulerConfig(
        mode=opts.mode, num_blocks=0 if live else opts.num_blocks, frames_per_block=frames_per_block,
        drafter_steps=drafter_steps, live=live, max_held_target_commits=max_held_target_commits,
        record_blocks=record_blocks, prefix_frames=prefix_frames,
        drafter_recompute=drafter_recompute, target_recompute=target_recompute,
        own_context=opts.drafter_context == "own", skips_first_draft=opts.skips_first_draft,
        lazy_target_commit=opts.lazy_target_commit, score_emitted=opts.score_emitted, run_ahead=opts.run_ahead,
        run_ahead_blocks=opts.run_ahead_blocks)


def setup_scheduler_config(opts: GenerationOptions, setup, live: bool = False, max_held_target_commits: int = 0,
                           record_blocks: int = 0):
    """`scheduler_config` for a prepared video (each role's schedule and context mode)."""
    d, t = setup.drafter, setup.target
    return scheduler_config(opts, setup.frames_per_block, d.schedule.num_steps if d else 1,
                            bool(d and d.context.recompute), bool(t and t.context.recompute), live,
                            max_held_target_commits, record_blocks, d.prefix_frames if d else 0)


def generate_blocks_native(comps: Components, prompt: str, opts: GenerationOptions, report: LoopReport | None = None,
                           runners=None, threaded: bool = True,
                           memory_budget_gib: float | None = None, video_input=None,
                           plan=None, start_latents=None) -> Iterator[BlockRecord]:
    """Same contract as `reference.generate_blocks` (`plan`: a live session, `start_latents`: a start frame's
    latents, as there), run by the native scheduler.

    threaded=True runs the scheduler on a worker thread and yields each block as it is emitted;
    threaded=False runs it on the calling thread and yields the blocks at the end (whole-video calls). A
    live session runs threaded."""
    live = plan is not None  # a live session: stopped by its plan alone, its blocks handed over through a bounded queue
    if live and not threaded:
        raise ValueError("a live session's native scheduler runs on its own thread (threaded=True)")
    forwards = Counters()  # the models count their forwards here; the scheduler counts the rest
    setup = prepare(comps, prompt, opts, forwards, slack_frames=setup_slack(comps, opts.run_ahead), runners=runners,
                    memory_budget_gib=memory_budget_gib, start_latents=start_latents,
                    keep_clean=live and plan.recaches)
    plan = plan if live else FixedPlan(opts, setup.conditioning)
    sink: queue.Queue = queue.Queue(maxsize=LIVE_QUEUED_BLOCKS if live else 0)
    stages = StageCalls(comps, opts, setup, plan, sink=sink, video_input=video_input)
    sched = _C.Scheduler(
        setup_scheduler_config(opts, setup, live=live, max_held_target_commits=plan.max_held_commits or 0,
                               record_blocks=plan.record_blocks or 0), stages,
        setup.drafter.cache if setup.drafter else None, setup.target.cache if setup.target else None,
        comps.drafter_device, comps.target_device)
    errors: list[BaseException] = []

    def body():
        try:
            sched.run()
        except BaseException as exc:  # handed to the consumer
            errors.append(exc)
        finally:
            sink.put(_DONE)

    def finish_run() -> list[BaseException]:
        """The scheduler is done (finished, failed or cancelled): report what it did; returns its error, taken
        out of `errors`: an error's traceback holds body's frame, the frame its function, whose cells hold
        `errors` (a cycle) and `sched` (the stage calls, the KV caches). Emptied, the scheduler and its caches go
        by reference counting with the error, not at the next garbage collection (a live session's close or
        restart would hold GPU memory for an unknown time)."""
        device_times = stages.events.resolve()  # events: waits for every stage's last work (caches final)
        if report is not None:
            counters = sched.counters()
            counters.drafter_forwards, counters.target_forwards = forwards.drafter_forwards, forwards.target_forwards
            report.stage_device_s = device_times
            report.compile = stages.compile_clock.since() if stages.compile_clock is not None else None
            report.counters = counters
            report.trace = sched.trace()
            report.final_times = dict(enumerate(sched.block_times(), start=sched.first_record()))
            report.drafter_cache = setup.drafter.cache if setup.drafter else None
            report.target_cache = setup.target.cache if setup.target else None
        failed, errors[:] = errors[:], []
        return failed

    if not threaded:
        body()
        failed = finish_run()
        while (item := sink.get()) is not _DONE:
            yield item
    else:
        worker = threading.Thread(target=body, name="sdvg-scheduler", daemon=True)
        worker.start()
        try:
            while True:
                item = sink.get()
                if item is _DONE:
                    break
                yield item
        finally:
            sched.cancel()  # no-op when finished; stops the scheduler if the consumer went away
            while worker.is_alive():  # a bounded queue: the scheduler may be waiting to hand a block over
                try:
                    sink.get(timeout=0.05)
                except queue.Empty:
                    pass
            worker.join()
            failed = finish_run()  # also when the consumer left early (a live session's close)
    if failed:  # a consumer that left early never gets here (GeneratorExit at its yield): the run's own error
        raise failed[0]


def setup_slack(comps: Components, run_ahead: bool) -> int:
    """Run-ahead rolls the drafter back over one speculative block and the draft written after it:
    a windowed cache needs two blocks of slack for that rollback to be exact."""
    return 2 * comps.preset.video.frames_per_block if run_ahead else 0
