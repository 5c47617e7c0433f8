"""A live session: one video whose prompt, seed and router threshold change between blocks, unbounded
when asked (docs/live.md).

The session drives either loop with itself as the loop's plan: the reference loop
(`sdvg/generation/reference.py`) calls `begin(b)` before each block; the native scheduler
(`scheduler="cpp"`) asks `StageCalls.plan(b)`, which calls it, from the thread that reaches block b
first (under run-ahead, the drafter's lane). `begin(b)`, under the session's lock, applies the updates
due at that block, freezes the block's conditioning (`ConditioningTable`) and counts the block as started;
the step it returns carries that conditioning as a value and the roles that re-cache under it.
`update()` (any thread) acknowledges an update at the first block not yet started, so every update
takes effect exactly at a block boundary and a live run replays offline from its recorded schedule
(`stats["live"]["updates"]`, the `prompt_schedule` format). A restart (`seed=` / `reset=True`) ends the
current segment and runs a fresh one (new caches, block 0 forced) on the same session; block indices
of the session go on counting (`BlockRecord.live["block"]`), `BlockRecord.index` restarts at 0."""
from __future__ import annotations

import dataclasses
import threading

from sdvg.generation.calls import StageCalls
from sdvg.generation.plan import STOP, BlockStep, Conditioning, forced_block, recaching_roles
from sdvg.generation.routers import Router
from sdvg.generation.run import RunContext, run_blocks
from sdvg.generation.video_input import InputEnded
from sdvg.generation.types import LoopReport, RunStats, block_times
from sdvg.live.conditioning import ConditioningTable, PromptBank
from sdvg.live.updates import Update, UpdateAck, UpdateError
from sdvg.options import GenerationOptions, OptionError


# lazy target commits a session holds back at most (bitwise the same video): without a cap an unbounded session's
# would pile up while every block is accepted, and a held block's conditioning must still be in the table
MAX_HELD_COMMITS = 4
assert MAX_HELD_COMMITS < min(ConditioningTable.KEEP, StageCalls.STEPS_KEPT)
RECORD_BLOCKS = 1000  # an unbounded session's default `record_blocks`: the block entries and trace kept


def unbounded_horizon(components, opts: GenerationOptions, prefix_frames: int = 0) -> int:
    """Blocks an unbounded session can reach: a full-context role places block b at absolute frame
    prefix_frames + b * frames_per_block (`prefix_frames`: a start frame's), so the RoPE table bounds it; a
    recompute-only session has no bound (its positions restart at the context length), the caches are sized
    for one table's length anyway."""
    rope = min(getattr(components, r).config.rope_max_seq_len for r in opts.roles)
    return max((rope - prefix_frames) // components.preset.video.frames_per_block - 1, 1)


def session_options(resolve, components, options: GenerationOptions, num_blocks: int | None,
                    start_frame: bool = False) -> tuple[GenerationOptions, int | None]:
    """(a session's resolved options, its last block + 1 or None): `num_blocks` blocks, or with None an unbounded
    session, whose caches are sized for the blocks a full-context role can reach (`unbounded_horizon`; the session
    stops there) or, recompute only, for one RoPE table's length (no end). `resolve`: the pipeline's option
    resolution (`SpeculativeVideoPipeline.resolve`); `start_frame`: a start frame's frames come before block 0."""
    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise OptionError(f"num_blocks {num_blocks!r} must be a positive integer, or None for an unbounded session")
    if num_blocks is not None:
        return resolve(options.replace(num_blocks=num_blocks)), num_blocks
    opts = resolve(options.replace(num_blocks=1))
    check_unbounded(opts)
    prefix = opts.kv_cache_frames if start_frame else 0
    opts = resolve(options.replace(num_blocks=unbounded_horizon(components, opts, prefix)))
    return opts, opts.num_blocks if any(opts.context_mode(r) == "full" for r in opts.roles) else None


def check_unbounded(opts: GenerationOptions) -> None:
    """An unbounded session needs bounded memory: every full-context role a window (or recompute)."""
    for role in opts.roles:
        if opts.context_mode(role) == "full" and not opts.window_frames:
            flag = "target_context='recompute'" if role == "target" else "drafter_cache='recompute'"
            raise OptionError(f"an unbounded session (num_blocks=None) cannot keep the {role}'s full history: its KV "
                              f"cache would grow without end; give a window (window_frames=N, sink_frames=M), use the "
                              f"recompute context ({flag}) or a finite num_blocks")


def _input_source(preset, input_video, input_frames: bool, timeout_s, queue_frames: int = 1024,
                  drop_oldest: bool = False):
    """(the session's frame source or None, the wait per block): a clip's frames, or frames pushed live (at most
    `queue_frames` waiting; one more is refused, or with `drop_oldest` the oldest makes room)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
        raise OptionError(f"input_timeout_s {timeout_s!r} must be a number of seconds in (0, 3600]; a block waits "
                          "that long for its pushed frames before the session ends")
    if not isinstance(input_frames, bool):
        raise OptionError(f"input_frames must be True or False, got {input_frames!r}")
    from sdvg.generation.video_input import ClipFrames, LiveFrames

    v = preset.video
    if input_video is not None:
        return ClipFrames(input_video, v.height, v.width), float(timeout_s)
    if input_frames:
        if isinstance(queue_frames, bool) or not isinstance(queue_frames, int) or queue_frames < 12:
            raise OptionError(f"input_queue_frames {queue_frames!r} must be an integer >= 12 (a block reads 12 frames)")
        return LiveFrames(v.height, v.width, queue_frames, bool(drop_oldest)), float(timeout_s)
    return None, float(timeout_s)


def _next_router(router: Router, update: Update) -> Router:
    """`router` with the update's router options, checked together as the options are (UpdateError)."""
    values = {"router": router.kind, "tau": router.tau, "accept_prob": router.accept_prob, "pattern": router.pattern}
    values.update(update.router_changes)
    try:
        return Router.from_options(GenerationOptions(**values))
    except (OptionError, TypeError, ValueError) as exc:
        raise UpdateError(f"the router options would be {values['router']!r} with {exc}") from None


def kept_blocks(record_blocks: int | str | None, num_blocks: int | None) -> int | None:
    """The block entries a session's statistics keep (`record_blocks`): 'auto' is every block of a bounded session
    (None) and the last RECORD_BLOCKS of an unbounded one; a bad value is refused (OptionError)."""
    if record_blocks == "auto":
        return None if num_blocks is not None else RECORD_BLOCKS
    if record_blocks is not None and (isinstance(record_blocks, bool) or not isinstance(record_blocks, int)
                                      or record_blocks < 1):
        raise OptionError(f"record_blocks {record_blocks!r} must be a positive integer (the block entries the "
                          "statistics keep, the oldest folded into the totals), None (all) or 'auto'")
    return record_blocks


class LiveSession:
    """Iterate to get each `BlockRecord` as soon as it is final; `update(...)` from any thread;
    `close()` ends it (its `stats` are then final). `pipe.session(...)` makes one: `context` is what its runs
    need (`RunContext`), `opts` its resolved options and `limit` its end (`session_options`), `num_blocks` the
    blocks asked (None: unbounded), `record_blocks` the block entries its statistics keep (`kept_blocks`; the
    pipeline checks it and the prompt before any work); `start_latents` a start frame's encoded latents (`start_frame`: the image,
    uint8 [H, W, 3], for the statistics)."""

    def __init__(self, context: RunContext, prompt: str, opts: GenerationOptions, num_blocks: int | None = None,
                 limit: int | None = None, schedule: list | None = None, input_video=None,
                 input_frames: bool = False, input_timeout_s: float = 30.0, input_queue_frames: int = 1024,
                 input_drop_oldest: bool = False, record_blocks: int | None = None, start_latents=None,
                 start_frame=None):
        self.record_blocks = record_blocks
        self.context, self.limit, self.opts = context, limit, opts
        components = context.components
        self.preset = components.preset
        # lazy target commits the loop may hold: a few, committed oldest first once past it
        self.max_held_commits = MAX_HELD_COMMITS
        self.recaches = opts.recache  # (the plan's) a full-context role re-caches under a new conditioning
        # a start frame's latents: the context of every segment's block 0
        self._start_latents = start_latents
        self.table = ConditioningTable(PromptBank(components.text_encoder), prompt)
        self._lock = threading.Lock()
        self._started = 0  # session blocks whose conditioning is frozen (drafting may have begun)
        self._pending: list[UpdateAck] = []
        self.updates: list[UpdateAck] = []
        self._closed = False
        self._running = False
        self._seed = opts.seed
        self._router = Router.from_options(opts)  # the router of the blocks being started
        self._router_acked = self._router  # ... and after every acknowledged update (checked against it)
        self._segment_start, self._segments = 0, 0
        self._recache_forwards = 0
        # the running segment's report; a finished one is folded into the session's totals at once, so a long
        # session with many restarts holds one segment's report (and no finished segment's KV caches)
        self._report: LoopReport | None = None
        self._counter_totals: dict[str, float] = {}
        self._spans: list[tuple[int, dict]] = []  # (segment, span) of the finished segments
        self._stage_device_s: dict[str, float] | None = None
        self._compile: dict | None = None  # backend compile: the segments' compile costs summed
        self._records_live: dict[int, dict] = {}
        self.stats = RunStats(prompt, self.preset.name, opts, context.provenance, keep_blocks=record_blocks)
        self.stats.extra.update(live=True, num_blocks=num_blocks, updates=[], prompts=self.table.prompts)
        self.finished = False
        self._source, self.input_timeout_s = _input_source(self.preset, input_video, input_frames, input_timeout_s,
                                                           input_queue_frames, input_drop_oldest)
        self._video = None  # the running segment's VideoInput
        self.input_ended: str | None = None  # why the input ended the session (a live source's timeout)
        if input_video is not None:
            self.stats.extra["input_video"] = {"source": "frames", "frames": int(len(input_video)),
                                               "height": int(input_video.shape[1]), "width": int(input_video.shape[2])}
        if start_frame is not None:
            self.stats.extra["start_frame"] = {"height": int(start_frame.shape[0]), "width": int(start_frame.shape[1]),
                                               "latent_frames": int(self._start_latents.shape[2])}
        for block, item in (schedule or [])[1:]:
            self._acknowledge(item, block)
        self._blocks = self._run()

    @property
    def segment_report(self) -> LoopReport | None:
        """The running segment's `LoopReport` (None before the first block and between segments), for
        observation: its loop fills it when the segment ends (counters, trace, the native scheduler's final
        times of the blocks it kept), just before the session folds it into its totals and lets it go. A caller
        that keeps it keeps that segment's KV caches."""
        return self._report

    @property
    def queued_input_frames(self) -> int:
        """Pushed input frames no block has read yet (a session started with input_frames=True; 0 otherwise):
        the backlog of a live video-to-video client."""
        from sdvg.generation.video_input import LiveFrames

        return self._source.queued() if isinstance(self._source, LiveFrames) else 0

    # ------------------------------------------------------------------ updates
    def update(self, prompt: str | None = None, interp_blocks: int | None = None, seed: int | None = None,
               reset: bool = False, tau: float | None = None, router: str | None = None,
               accept_prob: float | None = None, pattern=None, input_frames=None) -> UpdateAck:
        """Change the session from the first block whose drafting has not started (`UpdateAck.block`).
        `tau`, `router`, `accept_prob`, `pattern`: the router's options from then on. `input_frames` (uint8
        [N, H, W, 3], a session started with input_frames=True): queued for the blocks to come, in order; with
        no other change the ack's block is the block that will read the first of them (`UpdateAck.frames`:
        how many were queued). A bad value raises `UpdateError` and changes nothing."""
        changes = (prompt, interp_blocks, seed, tau, router, accept_prob, pattern)
        update = Update(prompt, interp_blocks, seed, reset, tau, router, accept_prob, pattern) \
            if reset or any(v is not None for v in changes) or input_frames is None else None
        if input_frames is None:
            return self._acknowledge(update, None)
        from sdvg.generation.video_input import LiveFrames
        from sdvg.io.video_input import VideoInputError, check_frames

        if not isinstance(self._source, LiveFrames):
            raise UpdateError("this session takes no pushed input frames; start it with pipe.session(..., "
                              "input_frames=True) for live video-to-video")
        try:
            frames = check_frames(input_frames)  # checked before anything changes
        except VideoInputError as exc:
            raise UpdateError(str(exc)) from None
        ack = None if update is None else self._acknowledge(update, None)
        queued = self._push_frames(frames)
        if ack is None:
            return UpdateAck(self._reading_block(queued), -1, None, frames=len(frames))
        return dataclasses.replace(ack, frames=len(frames))

    def _push_frames(self, frames) -> int:
        from sdvg.io.video_input import VideoInputError

        if self._closed or self.input_ended:
            raise RuntimeError("the session is closed; start a new one with pipe.session(...)")
        try:
            return self._source.push(frames)
        except VideoInputError as exc:
            raise UpdateError(str(exc)) from None

    def _reading_block(self, queued_before: int) -> int:
        """The session block that reads the first frame pushed after `queued_before` queued ones (FIFO; a
        restart in between moves it)."""
        with self._lock:
            video, start, started = self._video, self._segment_start, self._started
        b = 0 if video is None else video.next_block  # the segment block whose frames are taken next
        g = started if video is None else start + b
        left = queued_before
        while left >= self._frames_needed(b):
            left -= self._frames_needed(b)
            b, g = b + 1, g + 1
        return g

    def input_ready(self) -> bool:
        """Whether the next `next()` will not wait for pushed frames: no live input, the session ends there, or the
        next block's frames are queued (a server steps a session only then, so one webcam never stalls the
        others)."""
        from sdvg.generation.video_input import LiveFrames

        if not isinstance(self._source, LiveFrames) or self._closed or self.finished:
            return True
        with self._lock:
            if self.limit is not None and self._started >= self.limit:
                return True
            restart = any(a.block == self._started and a.update.restarts for a in self._pending)
            video = self._video
        block = 0 if video is None or restart else video.next_block
        return self._source.queued() >= self._frames_needed(block)

    def _frames_needed(self, block: int) -> int:
        v, vae = self.preset.video, self.preset.vae
        return v.pixel_frames(vae, 1) if block == 0 else vae.temporal_stride * v.frames_per_block

    def _acknowledge(self, update: Update, block: int | None) -> UpdateAck:
        with self._lock:
            if self._closed:
                raise RuntimeError("the session is closed; start a new one with pipe.session(...)")
            block = self._started if block is None else block
            if self.limit is not None and block >= self.limit:
                raise UpdateError(f"the update would take effect at block {block}, but the session ends after block "
                                  f"{self.limit - 1}; nothing is left to change")
            if update.router_changes:
                self._router_acked = _next_router(self._router_acked, update)
            ack = UpdateAck(block, len(self.updates), update)
            self.updates.append(ack)
            self._pending.append(ack)
            self.stats.extra["updates"].append(update.as_entry(block))
            return ack

    # ------------------------------------------------------------ the loop's plan
    def begin(self, b: int) -> BlockStep:
        """Before segment block b: apply the updates due, freeze its conditioning, count it started. Under
        video-to-video the block's input frames are taken first (a live source is waited for, outside the
        lock, so updates go on arriving; frames that do not come end the session)."""
        with self._lock:
            g = self._started
            if self._stops(b, g):
                return STOP
        if self._video is not None:
            try:
                self._video.fetch(b)
            except InputEnded as exc:
                if not self._closed:
                    self.input_ended = str(exc)
                return STOP
        with self._lock:
            if self._stops(b, g):  # close() or a restart came while the frames were awaited
                if self._video is not None:
                    self._video.unread()
                return STOP
            due = [a for a in self._pending if a.block == g]
            restart = b == 0 and g > 0
            for a in due:
                self._pending.remove(a)
                u = a.update
                if u.router_changes:
                    self._router = _next_router(self._router, u)
                if u.prompt is not None:
                    self.table.switch(g, u.prompt, 1 if restart else (u.interp_blocks or self.opts.interp_blocks))
            cond = self.table.freeze(g)
            previous = self.table.frozen[g - 1].key if b > 0 else None
            forced = forced_block(self.opts, b, after_switch=cond.first_new)
            forced_by_update = forced and not forced_block(self.opts, b)
            self._started += 1
            self._records_live[b] = {"block": g, "segment": self._segments, "prompt_index": cond.prompt_index,
                                     "blend_weight": cond.weight, "forced_by_update": forced_by_update}
            last = self.limit is not None and g == self.limit - 1
            return BlockStep(False, last, forced, self._router, Conditioning(cond.key, cond.prompt, cond.emb),
                             recaching_roles(self.opts, b, cond.key, previous))

    def _fold_segment(self) -> None:
        """The finished segment's report into the session's totals: counters summed, device seconds summed,
        the native scheduler's final per-block times onto its kept entries, its spans (those of kept entries
        when `record_blocks` bounds them); then the report, with its KV caches, is let go."""
        report, self._report = self._report, None
        if report is None or report.counters is None:  # none running, or a segment that never ran
            return
        for k, v in report.counters.as_dict().items():
            self._counter_totals[k] = self._counter_totals.get(k, 0) + v
        if report.stage_device_s is not None:
            total = self._stage_device_s or {}
            self._stage_device_s = {k: total.get(k, 0.0) + v for k, v in report.stage_device_s.items()}
        if report.compile is not None:  # the counts summed over the segments, the settings kept
            total = self._compile or {}
            self._compile = {k: (total.get(k, 0) + v if isinstance(v, (int, float)) else v)
                             for k, v in report.compile.items()}
        seg = self._segments
        if report.final_times is not None:  # run-ahead: a drafter commit may end after its block is emitted
            for b in self.stats.blocks:
                if b["live"]["segment"] == seg and (final := report.final_times.get(b["index"])) is not None:
                    b["times"] = block_times(final)
        self._spans.extend((seg, span) for span in report.trace)
        if self.record_blocks is not None:  # the spans of the blocks whose entries are kept
            kept = {(b["live"]["segment"], b["index"]) for b in self.stats.blocks}
            self._spans = [(sg, span) for sg, span in self._spans if (sg, span["block"]) in kept]

    def _stops(self, b: int, g: int) -> bool:
        """(under the lock) Session block g (segment block b) is not produced: closed, past the last block,
        or a restart is due there (the segment ends; the next one starts at g)."""
        if self._closed or (self.limit is not None and g >= self.limit):
            return True
        return b > 0 and any(a.block == g and a.update.restarts for a in self._pending)

    # ------------------------------------------------------------------- blocks
    def _run(self):
        while True:
            with self._lock:
                restart = [a for a in self._pending if a.block == self._started and a.update.restarts]
                if self._started > 0 and not restart:
                    break
                for a in restart:  # (a restart due at block 0 only sets the seed of the first segment)
                    if a.update.seed is not None:
                        self._seed = a.update.seed
                if self._started > 0:
                    self._segments += 1
                self._segment_start = self._started
                prompt = self.table._current.prompt if self._started else self.table.prompts[0]
            report = self._report = LoopReport()
            self._records_live = {}
            opts = self.opts.replace(seed=self._seed)
            if self._source is not None:
                from sdvg.generation.video_input import VideoInput
                from sdvg.models.vae_encoder import StreamingVAEEncoder

                self._video = VideoInput(self._source, StreamingVAEEncoder(self.context.components.vae.vae),
                                         self.preset.video.frames_per_block, self.input_timeout_s)
            for record in run_blocks(self.context, prompt, opts, report, plan=self, video_input=self._video,
                                     start_latents=self._start_latents):
                record.live = self._records_live.pop(record.index)
                record.live["recache_forwards"] = record.recache_forwards
                self._recache_forwards += record.live["recache_forwards"]
                yield record
            self._fold_segment()
            if self._closed or self.input_ended or (self.limit is not None and self._started >= self.limit):
                break

    def __iter__(self) -> "LiveSession":
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        self._running = True
        try:
            block = next(self._blocks)
        except StopIteration:
            self._finish(interrupted=False)
            raise
        except BaseException:
            self._running = False
            self.close()
            raise
        finally:
            self._running = False
        self.stats.add(block)
        return block

    def close(self) -> RunStats:
        """End the session (from any thread): no block starts after this; the stats are final once the
        block being produced (if any) is done. Returns the stats."""
        with self._lock:
            self._closed = True
        if self._source is not None and hasattr(self._source, "close"):
            self._source.close()  # a block waiting for pushed frames stops waiting
        if not self._running and not self.finished:
            self._blocks.close()
            self._finish(interrupted=self.limit is not None and self._started < self.limit)
        return self.stats

    def _finish(self, interrupted: bool) -> None:
        if self.finished:
            return
        self.finished = True
        with self._lock:
            self._closed = True
        self._fold_segment()  # the last segment (its loop filled the report when the consumer left)
        with self._lock:
            self._video = None  # its encoder's caches: a closed session holds no tensors of its run
        self.stats.finish(None, interrupted=interrupted)
        self.stats.counters = dict(self._counter_totals)
        self.stats.trace = [span for _, span in self._spans]
        self.stats.stage_device_s = self._stage_device_s
        self.stats.compile = self._compile
        self.stats.extra.update(segments=self._segments + 1, prompt_encodes=self.table.bank.encodes,
                                blocks_started=self._started, recache_forwards=self._recache_forwards)
        if self.input_ended:
            self.stats.extra["input_ended"] = self.input_ended
        if input_frames_pushed := getattr(self._source, "pushed", None):
            self.stats.extra["input_video"] = {"source": "live", "frames": int(input_frames_pushed),
                                               "height": self.preset.video.height,
                                               "width": self.preset.video.width}

    def __enter__(self) -> "LiveSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
