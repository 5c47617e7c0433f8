"""Several videos' stage calls batched together: the model work of many live sessions in one call.

Each video keeps its own loop (`reference.py`), its own KV caches, VAE cache, plan and conditioning. A
`StageBatcher` runs one block of each of several videos as a *round* (`run_round`): every video's loop
runs on a thread of its own, but only one thread runs at a time (a turn passes from thread to thread, so
no two loops ever touch a model at once, and the order of everything is fixed by the videos' order and
deadlines, not by the operating system). A loop that reaches a call the batcher can batch (`denoise`,
`commit`, `decode`, `score`) hands its request over and waits; once every video of the round waits or has
its block, the batcher runs the waiting requests that can go together with the earliest-deadline one as
one call, gives each video its own rows, and the loops go on. Calls on different devices run at the same
time (two GPUs: the drafters' and the targets' calls of a round, each device one call). Work that cannot
be batched runs in its loop's turn, as alone.

What goes together (each request's `key`): the same DiT in the same role, block shape and schedule; VAE
decodes whose caches stack; ImageReward on frames of one size. What never does is one rule, `why_alone`
(the backend, CUDA graphs, early exit, a recompute context, fast_vae), which the stage calls ask before
they hand a request over.

Exactness. A DiT row's arithmetic is its video's alone: its own RoPE position, its own self-attention over
its own cache (`CausalWanDiT.forward_rows`), its own noise draws; the linears, norms and cross-attention
run on the stacked rows, and the few operations whose CPU kernel the row count changes run row by row; the
reward head runs per video. So where the CPU's matrix products give a row the same result in a taller
stack, a video's latents, forwards and caches are bitwise its own alone: tiny's sizes (the tests), and
cpu-bench's up to two sessions; cpu-bench's target at three or more (216+ rows of 1536 inputs, 2 threads)
is not batch-invariant, and there the rows agree within float rounding, the decisions with them.
The VAE's convolutions are not batch-invariant (the CPU's pick other kernels for a larger batch), so a
batched decode's pixels differ from a decode alone in the last bits (about 1e-5 in [-1, 1]; a uint8 frame
by at most one level, the VAE's cache carrying them to the next blocks) and so do the scores read from them
(tiny's random reward model: within 1e-3): the decisions agree unless a score lies that close to tau, and
the latents then stay bitwise (nothing the DiTs read comes from pixels; a recompute context, which
re-encodes emitted frames, decodes alone). `StageBatcher(batch_decode=False)` decodes each video alone:
every session is then bitwise its own, frames and scores included. The tests' oracle is `pipe.session`
run by itself (tests/test_batching.py); on a GPU, where cuBLAS may pick other kernels for a larger batch
too, the tolerance table of docs/invariants.md applies and the decisions must agree.

Outside a round (a video run by itself) every call runs at once, as alone: the batcher changes nothing then.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sdvg.models.device_constants import to_device_async
from sdvg.models.dit import TextKV
from sdvg.generation.noise import gaussian


def why_alone(opts, part: str) -> str | None:
    """Why `part`'s calls in a video of resolved `opts` never join other videos' (None: they may). `part`: a role
    ("drafter", "target": its denoising and commits), "vae" (its decodes) or "reward" (its scoring). The one rule:
    the stage calls ask it, and the server tells a session."""
    if opts.backend != "eager":
        return f"backend {opts.backend!r}: batched calls run the eager modules"
    if part == "reward":
        return None
    if part == "vae":
        if opts.fast_vae:
            return "fast_vae: its own decode path"
        if any(opts.role_context(r).recompute for r in opts.roles):
            return ("a recompute context re-encodes the emitted frames: a batched decode's last-bit differences "
                    "would reach its latents")
        return None
    role = part
    if opts.cuda_graphs:
        return "cuda_graphs: a captured graph replays one video's shapes"
    if opts.early_exit != "none":
        return "early_exit: each token leaves the denoising loop at its own step"
    if opts.role_context(role).recompute:
        return "a recompute context: the block's context is rebuilt before its denoising"
    return None


def _role_key(kind: str, model, rows: torch.Tensor, *more) -> tuple:
    """What requests of one call share: the kind, the role's DiT, the rows' shape and device."""
    return (kind, model.role, id(model.dit), tuple(rows.shape), str(model.device), *more)


@dataclass(frozen=True)
class RoleRequest:
    """A request of one role's DiT (`model`): what it goes with, where it runs and which lane counts it.

    Every request type answers the batcher's protocol: `key` (requests of one call share it), `device` (calls on
    different devices run at the same time), `lane` (what its seconds are counted under), `alone()` (the call of one
    video) and `run_together(requests)` (the call of several, each its own result)."""

    model: Any  # sdvg.generation.role_model.RoleModel

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def lane(self) -> str:
        return self.model.role


@dataclass(frozen=True)
class DenoiseRequest(RoleRequest):
    """One video's few-step denoising of a block (`RoleModel.denoise`'s arguments)."""

    noise: torch.Tensor  # [1, C, F, h, w] float32
    block: int
    seed: int
    text_kv: TextKV

    @property
    def key(self) -> tuple:
        schedule = self.model.schedule
        return _role_key("denoise", self.model, self.noise, schedule.num_steps,
                         tuple(float(t) for t in schedule.timesteps))

    def alone(self) -> torch.Tensor:
        m = self.model
        return m.denoise(self.noise, self.block, m.frame_of(self.block), self.seed, self.text_kv)

    @staticmethod
    def run_together(requests: list) -> list:
        return denoise_together(requests)


@dataclass(frozen=True)
class CommitRequest(RoleRequest):
    """One video's t = 0 forward over a block it commits (`RoleModel.commit_forward`'s arguments)."""

    latents: torch.Tensor  # [1, C, F, h, w] on the model's device
    frame0: int
    text_kv: TextKV

    @property
    def key(self) -> tuple:
        return _role_key("commit", self.model, self.latents)

    def alone(self) -> None:
        return self.model.commit_forward(self.latents, self.frame0, self.text_kv)

    @staticmethod
    def run_together(requests: list) -> list:
        return commit_together(requests)


@dataclass(frozen=True)
class DecodeRequest:
    """One video's streaming VAE decode of a block (`StreamingVAEDecoder.decode(latents, cache)`)."""

    vae: Any  # sdvg.models.vae.StreamingVAEDecoder
    latents: torch.Tensor  # [1, z, F, h, w] on the VAE's device
    cache: Any  # its VAEDecodeCache, advanced by the decode

    @property
    def key(self) -> tuple:
        c = self.cache  # caches stack when their entries agree in shape (or marker) and in the first-block state
        entries = tuple(tuple(e.shape[1:]) if isinstance(e, torch.Tensor) else e for e in c.entries)
        return ("decode", id(self.vae), tuple(self.latents.shape), str(self.latents.device), c.frames_decoded == 0,
                c.time_rule, c.time_slots, entries)

    @property
    def device(self) -> str:
        return str(self.latents.device)

    lane = "vae"

    def alone(self) -> torch.Tensor:
        return self.vae.decode(self.latents, self.cache)

    @staticmethod
    def run_together(requests: list) -> list:
        return decode_together(requests)


@dataclass(frozen=True)
class ScoreRequest:
    """One video's ImageReward of a block's frames: `score(prompt, unit_frames)` of the scorer."""

    scorer: Any  # sdvg.models.reward.RewardScorer
    prompt: str
    unit_frames: torch.Tensor  # [N, 3, H, W] in [0, 1]

    @property
    def key(self) -> tuple:
        return ("score", id(self.scorer), tuple(self.unit_frames.shape[1:]), str(self.unit_frames.device))

    @property
    def device(self) -> str:
        return str(self.unit_frames.device)

    lane = "reward"

    def alone(self) -> torch.Tensor:
        return self.scorer.score(self.prompt, self.unit_frames)

    @staticmethod
    def run_together(requests: list) -> list:
        return score_together(requests)


def denoise_together(requests: list[DenoiseRequest]) -> list[torch.Tensor]:
    """The requests' blocks denoised as one batch per step (`forward_rows`): row j is request j's block at its
    cache's write position under its conditioning, re-noised with its own draws -> each x0 [1, C, F, h, w]."""
    models = [r.model for r in requests]
    m0 = models[0]
    for r in requests:
        m = r.model
        if m.frame_of(r.block) != m.committed_frames:
            raise ValueError(f"{m.role}: block {r.block} starts at frame {m.frame_of(r.block)} but "
                             f"{m.committed_frames} frames are committed; commit every earlier block first")
    n = len(requests)
    x = torch.cat([to_device_async(r.noise, m0.device) for r in requests])  # [n, C, F, h, w]
    text = _stacked_text(requests)
    caches = [m.cache for m in models]
    steps = m0.schedule.num_steps
    for i in range(steps):
        t = torch.full((n, x.shape[2]), m0.schedule.timesteps[i], device=m0.device)
        x0 = m0.schedule.to_x0(x, m0.dit.forward_rows(x, t, text, caches), i)
        for m in models:
            m.count_forward()
        if i + 1 < steps:
            x = torch.cat([m0.schedule.renoise(x0[j:j + 1], gaussian(x0[j:j + 1].shape, r.seed, r.block, i + 1,
                                                                     r.model.role, r.model.device), i + 1)
                           for j, r in enumerate(requests)])
        else:
            x = x0
    return list(x.split(1))


def _stacked_text(requests) -> TextKV:
    layers = range(len(requests[0].text_kv.keys))
    return TextKV([torch.cat([r.text_kv.keys[i] for r in requests]) for i in layers],
                  [torch.cat([r.text_kv.values[i] for r in requests]) for i in layers])  # each [n, H, L, D]


def commit_together(requests: list[CommitRequest]) -> list[None]:
    """The requests' t = 0 forwards in one call (`forward_rows`): each block's K/V into its own cache's pending slots
    (the loop moves each pointer, as after `commit_forward`)."""
    for r in requests:
        if r.frame0 != r.model.committed_frames:
            raise ValueError(f"{r.model.role}: committing a block at frame {r.frame0}, expected "
                             f"{r.model.committed_frames}")
    m0 = requests[0].model
    x = torch.cat([r.latents.to(m0.device) for r in requests])
    m0.dit.forward_rows(x, torch.zeros((x.shape[0], x.shape[2]), device=m0.device), _stacked_text(requests),
                        [r.model.cache for r in requests])
    for r in requests:
        r.model.committed(r.latents, r.frame0)
    return [None] * len(requests)


def decode_together(requests: list[DecodeRequest]) -> list[torch.Tensor]:
    """The requests' blocks decoded as one batch: their caches stacked row by row into one, decoded, and each video's
    rows handed back to its own cache -> each pixels [1, 3, T, H, W]. Not bitwise each decode alone where the
    convolutions pick other kernels for a larger batch (the CPU's do: pixels within about 1e-5)."""
    first = requests[0].cache
    merged = type(first)(len(first.entries), first.time_rule, first.time_slots)
    merged.entries = [torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0]
                      for column in zip(*(r.cache.entries for r in requests))]
    merged.frames_decoded = first.frames_decoded
    pixels = requests[0].vae.decode(torch.cat([r.latents for r in requests]), merged)
    for j, r in enumerate(requests):
        r.cache.entries = [e[j:j + 1] if isinstance(e, torch.Tensor) else e for e in merged.entries]
        r.cache.frames_decoded = merged.frames_decoded
    return list(pixels.split(1))


def score_together(requests: list[ScoreRequest]) -> list[torch.Tensor]:
    """The requests' frames scored in one ImageReward call, each frame with its own video's prompt -> each
    request's normalised scores [N_j]."""
    scorer = requests[0].scorer
    images = torch.cat([scorer.preprocess(r.unit_frames) for r in requests])
    ids, masks = [], []
    for r in requests:
        tok = scorer.tokens(r.prompt)
        count = r.unit_frames.shape[0]
        ids.append(tok.ids.expand(count, -1))
        masks.append(tok.mask.expand(count, -1))
    rows = [r.unit_frames.shape[0] for r in requests]
    with torch.no_grad():
        scores = scorer.score_images(images, torch.cat(ids), torch.cat(masks), rows)
    return list(scores.split(rows))


@dataclass
class _Member:
    """One video's thread in a round."""

    index: int
    job: Callable[[], Any]
    state: str = "ready"  # ready (its turn may come), waiting (a request handed over), done
    request: Any = None
    result: Any = None
    outcome: Any = None  # the job's return value, or the exception it raised
    failed: bool = False


class _Call:
    """One batched call of a round: its members' requests run together (`run_together`), timed; an exception reaches
    every member of the call."""

    def __init__(self, group: list[_Member]):
        self.group, self.results, self.failed, self.seconds = group, [], False, 0.0

    def run(self) -> None:
        requests = [m.request for m in self.group]
        t0 = time.perf_counter()
        try:
            self.results = type(requests[0]).run_together(requests)
        except Exception as exc:  # every video of the call hears of it, in its own loop
            self.results, self.failed = [exc] * len(requests), True
        self.seconds = time.perf_counter() - t0


@dataclass
class BatchStats:
    """What the batcher's rounds ran (a round of one video too, its calls of one row): calls by (kind, rows); their
    seconds by lane (the role whose model ran: drafter, target; or vae, reward), until each call returned (on a
    GPU: its launches, unless the stage timing waits for the device); the rounds."""

    calls: collections.Counter = field(default_factory=collections.Counter)
    lane_seconds: collections.Counter = field(default_factory=collections.Counter)
    rounds: int = 0

    def record(self, request, rows: int, seconds: float) -> None:
        """One call of `rows` requests like `request`, which took `seconds`."""
        self.lane_seconds[request.lane] += seconds
        self.calls[(request.key[0], rows)] += 1

    def rows(self, kind: str) -> int:
        return sum(size * count for (k, size), count in self.calls.items() if k == kind)


class StageBatcher:
    """Runs rounds of several videos' loops, one thread at a time, and their batchable model work together
    (module docstring). `max_rows`: the most rows one call takes. One round at a time: `run_round` is called
    from one thread (the serving worker)."""

    def __init__(self, max_rows: int = 8, batch_decode: bool = True):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        # VAE decodes batched too (the largest gain where the VAE dominates, as on the CPU's tiny preset); False:
        # each decode alone, every session bitwise its own (module docstring)
        self.batch_decode = batch_decode
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._turn: _Member | None = None
        self._local = threading.local()

    # ------------------------------------------------------------ from a video's loop
    def denoise(self, model, noise: torch.Tensor, block: int, seed: int, text_kv) -> torch.Tensor:
        """`model.denoise(noise, block, frame_of(block), seed, text_kv)`, batched with the round's other videos'
        denoising of the same kind (alone outside a round). The caller asks `why_alone` first: a role that must run
        alone never comes here."""
        return self.request(DenoiseRequest(model, noise, block, seed, text_kv))

    def commit(self, model, latents: torch.Tensor, frame0: int, text_kv) -> None:
        """`model.commit_forward(latents, frame0, text_kv)` of a full context, batched with the round's other
        commits of the same kind."""
        return self.request(CommitRequest(model, latents, frame0, text_kv))

    def decode(self, vae, latents: torch.Tensor, cache) -> torch.Tensor:
        """`vae.decode(latents, cache)` (the eager streaming decode), batched with the round's other decodes whose
        caches stack (`DecodeRequest.key`)."""
        return self.request(DecodeRequest(vae, latents, cache))

    def score(self, scorer, prompt: str, unit_frames: torch.Tensor) -> torch.Tensor:
        """`scorer.score(prompt, unit_frames)` (the eager scorer), batched with the round's other scoring."""
        return self.request(ScoreRequest(scorer, prompt, unit_frames))

    def request(self, request):
        """Hands `request` over from a video's loop and returns its result: at once outside a round
        (`request.alone()`), else once the round's calls reach it, batched with the waiting requests of its `key`
        (`type(request).run_together`). A request type has `key` (what may go together), `device` (calls on
        different devices run at the same time), `alone()` and `run_together(requests) -> results`."""
        member = getattr(self._local, "member", None)
        if member is None:  # outside a round (or a round of one video: counted): as alone, at once
            if not getattr(self._local, "counted", False):
                return request.alone()
            t0 = time.perf_counter()
            try:
                return request.alone()
            finally:
                self.stats.record(request, 1, time.perf_counter() - t0)
        with self._cond:
            member.request, member.state = request, "waiting"
            self._turn = None
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn is member)
        result, member.result = member.result, None
        if member.failed:
            member.failed = False
            raise result
        return result

    # ------------------------------------------------------------ the round
    def run_round(self, jobs: list[Callable[[], Any]], deadlines: list[float] | None = None,
                  on_done: Callable[[int, bool, Any], None] | None = None) -> list[tuple[bool, Any]]:
        """Runs each job (one video's next block, e.g. `lambda: next(session)`) on its own thread, one at a time,
        their batchable requests together -> per job, in order: (True, its return value) or (False, the
        exception it raised, StopIteration included).

        `deadlines` (one per job, any comparable value such as a time; None: the jobs' order): earliest deadline
        first, both for whose turn comes first and for which waiting call runs next (the one holding the
        earliest-deadline request, with every waiting request of its kind). `on_done(index, ok, outcome)` is
        called on this thread as soon as a job ends, while the round goes on (a finished block need not wait for
        the round's slowest)."""
        if len(jobs) == 1:  # nothing to batch with: the job on this thread, its calls as alone (no turns to pass),
            self._local.counted = True  # counted as calls of one row
            try:
                outcome = (True, jobs[0]())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, StopIteration included
                outcome = (False, exc)
            finally:
                self._local.counted = False
            if on_done is not None:
                on_done(0, *outcome)
            self.stats.rounds += 1
            return [outcome]
        members = [_Member(i, job) for i, job in enumerate(jobs)]
        order = sorted(members, key=lambda m: (deadlines[m.index], m.index) if deadlines else m.index)
        threads = [threading.Thread(target=self._member_main, args=(m,), name=f"sdvg-batch-{m.index}", daemon=True)
                   for m in members]
        for t in threads:
            t.start()
        with self._cond:
            while True:
                for m in order:  # each ready video runs until it hands a request over or has its block
                    if m.state == "ready":
                        self._turn = m
                        self._cond.notify_all()
                        self._cond.wait_for(lambda: self._turn is None)
                        if m.state == "done" and on_done is not None:
                            self._cond.release()  # the caller's work (sending a block) holds no turn
                            try:
                                on_done(m.index, not m.failed, m.outcome)
                            finally:
                                self._cond.acquire()
                waiting = [m for m in order if m.state == "waiting"]
                if not waiting:
                    break
                groups = self._groups(waiting)
                calls = [_Call(group) for group in groups]
                others = [threading.Thread(target=c.run, name="sdvg-batch-lane", daemon=True) for c in calls[1:]]
                for t in others:  # calls on other devices at the same time (two GPUs: drafter and target lanes)
                    t.start()
                calls[0].run()
                for t in others:
                    t.join()
                for c in calls:
                    self.stats.record(c.group[0].request, len(c.group), c.seconds)
                    for m, r in zip(c.group, c.results):
                        m.result, m.failed, m.request, m.state = r, c.failed, None, "ready"
            self.stats.rounds += 1
        for t in threads:
            t.join()
        return [(not m.failed, m.outcome) for m in members]

    def _groups(self, waiting: list[_Member]) -> list[list[_Member]]:
        """The calls to run now, one per device: on each device, the waiting requests of the key of its earliest-
        deadline request (`waiting` is in deadline order), at most `max_rows`, the earliest deadlines first. Every
        video of a round waits on one request at a time, so the order of the calls never splits a batch: it decides
        only whose block is done first."""
        groups: dict[str, list[_Member]] = {}
        for m in waiting:
            device = m.request.device
            if device not in groups:
                key = m.request.key
                groups[device] = [w for w in waiting if w.request.key == key][:self.max_rows]
        return list(groups.values())

    def _member_main(self, member: _Member) -> None:
        self._local.member = member
        with self._cond:
            self._cond.wait_for(lambda: self._turn is member)
        try:
            member.outcome = member.job()
        except BaseException as exc:  # noqa: BLE001 - handed to run_round's caller, StopIteration included
            member.outcome, member.failed = exc, True
        with self._cond:
            member.state = "done"
            self._turn = None
            self._cond.notify_all()
