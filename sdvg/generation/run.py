"""One video's blocks on the loop its options name: the one run entry point, and the one place the
scheduler is chosen.

`run_blocks` is what `pipe()`, `pipe.stream()`, `pipe.run()` and a live session's segments (so the
server's sessions too) call (sdvg/pipeline.py, sdvg/live/session.py): `scheduler="cpp"` runs the native
scheduler (sdvg/generation/native.py), `"reference"` the plain Python loop (sdvg/generation/reference.py).
Both take the same arguments and give the same blocks, bitwise (docs/invariants.md). What a run needs
besides its prompt, options and plan is one small value, `RunContext` (a live session holds one, not the
pipeline). The blocks come as an iterator: each `next()` advances the video by one block (the reference
loop makes it on the calling thread; the native scheduler on its own thread, at most a block or two ahead
of a live plan's consumer)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from sdvg.generation.batching import StageBatcher
from sdvg.generation.native import generate_blocks_native
from sdvg.generation.plan import Plan
from sdvg.generation.reference import generate_blocks
from sdvg.generation.types import BlockRecord, LoopReport
from sdvg.models.components import Components
from sdvg.options import GenerationOptions


@dataclass(frozen=True)
class RunContext:
    """What a video's run needs besides its prompt, options and plan: the components, the stage runners of the
    options' backend (`StageRunners`), the memory budget (None: each device's free memory) and what produced it
    (`provenance`: the statistics' `run` group), and the batcher its model work goes through when it runs batched
    with other videos (`batching.StageBatcher`; the reference loop only; None: alone).
    `SpeculativeVideoPipeline.run_context(opts)` makes one."""

    components: Components
    runners: object
    memory_budget_gib: float | None
    provenance: dict
    batcher: StageBatcher | None = None


def run_blocks(context: RunContext, prompt: str, opts: GenerationOptions, report: LoopReport | None = None, *,
               plan: Plan | None = None, video_input=None, start_latents=None,
               threaded: bool = True) -> Iterator[BlockRecord]:
    """The blocks of one video (resolved `opts`; `plan`: the video's block plan, None for the `FixedPlan` of
    `opts`; `video_input`, `start_latents`: see `reference.generate_blocks`). `threaded`: the native scheduler
    runs on its own thread and yields each block as it is emitted (False: on the calling thread, the blocks at
    the end; a live plan always runs threaded). The reference loop runs on the calling thread either way."""
    comps, runners, budget = context.components, context.runners, context.memory_budget_gib
    if opts.scheduler == "cpp":
        if context.batcher is not None:
            raise ValueError("videos batched together run the reference loop (scheduler='reference'): the native "
                             "scheduler's lanes run their own threads, which a round of the batcher cannot take turns with")
        return generate_blocks_native(comps, prompt, opts, report, runners=runners, threaded=threaded,
                                      memory_budget_gib=budget, video_input=video_input, plan=plan,
                                      start_latents=start_latents)
    return generate_blocks(comps, prompt, opts, report, runners=runners, memory_budget_gib=budget,
                           plan=plan, video_input=video_input, start_latents=start_latents, batcher=context.batcher)
