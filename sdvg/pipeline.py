"""Diffusers-like API of sdvg.

    from sdvg import SpeculativeVideoPipeline
    pipe = SpeculativeVideoPipeline.from_preset("tiny")
    out = pipe("a red fox in the snow", mode="sdvg", tau=-0.7, num_blocks=9, seed=42)
    out.frames  # uint8 [F, H, W, 3]
    stream = pipe.stream("...", tau=-0.7)
    for block in stream: ...      # each block as soon as its frames are final
    stream.stats                  # RunStats, complete once the stream is exhausted

The keywords of `__call__` and `stream` are the generation options declared once in
`sdvg.options.GenerationOptions` (their defaults are read from there).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from sdvg.config import Preset, get_preset
from sdvg.generation.types import BlockRecord, LoopReport, RunStats
from sdvg.models.components import Components, build_random, load_pretrained
from sdvg.options import DEFAULTS as D
from sdvg.options import OPTION_NAMES, GenerationOptions


@dataclass
class PipelineOutput:
    frames: torch.Tensor  # uint8 [F, H, W, 3]
    latents: torch.Tensor  # float32 [1, z, B*frames_per_block, h, w], the emitted latents
    stats: RunStats
    blocks: list[BlockRecord]


def _options(keywords: dict) -> GenerationOptions:
    """The options given as `stream`/`__call__` keywords (their names are exactly OPTION_NAMES)."""
    return GenerationOptions(**{name: keywords[name] for name in OPTION_NAMES})


class BlockStream:
    """The blocks of one video as they are emitted (an iterator of `BlockRecord`).

    `stats` grows block by block and is complete (counters, trace, wall time) once the iterator is
    exhausted; `close()` stops an unfinished video (the native scheduler's thread included)."""

    def __init__(self, blocks: Iterator[BlockRecord], stats: RunStats, report: LoopReport):
        self._blocks, self.stats, self._report = blocks, stats, report

    def __iter__(self) -> "BlockStream":
        return self

    def __next__(self) -> BlockRecord:
        try:
            block = next(self._blocks)
        except StopIteration:
            self.stats.finish(self._report)
            raise
        self.stats.add(block)
        return block

    def close(self) -> None:
        self._blocks.close()


class SpeculativeVideoPipeline:
    def __init__(self, components: Components, backend: str = "eager", engines=None):
        self.components = components
        self.preset = components.preset
        self._runners: dict = {}  # stage backend -> StageRunners (compiled modules / engines), built on first use
        self.default_backend = backend
        self.engines = engines

    def runners(self, backend: str | None = None):
        from sdvg.generation.backends import StageRunners

        backend = backend or self.default_backend
        if backend not in self._runners:
            self._runners[backend] = StageRunners(self.components, backend, self.engines)
        return self._runners[backend]

    @classmethod
    def from_preset(cls, name: str | Preset = "tiny", seed: int = 0, device: str = "cpu",
                    target_device: str | None = None, backend: str = "eager", engines=None,
                    **preset_changes) -> "SpeculativeVideoPipeline":
        """A pipeline with random weights of a named preset (`tiny`, `cpu-bench`, `real-size`)."""
        preset = get_preset(name) if isinstance(name, str) else name
        if preset_changes:
            preset = dataclasses.replace(preset, **preset_changes)
        preset.validate()
        return cls(build_random(preset, seed=seed, drafter_device=device, target_device=target_device), backend,
                   engines)

    @classmethod
    def from_pretrained(cls, drafter, target, vae, reward, text_encoder, preset: str | Preset = "wan2.1",
                        reward_tokenizer=None, drafter_device="cuda:0", target_device=None, backend: str = "eager",
                        engines=None) -> "SpeculativeVideoPipeline":
        """Real weights from local paths or HF-cache folders (see sdvg.models.checkpoints for the formats)."""
        preset = get_preset(preset) if isinstance(preset, str) else preset
        return cls(load_pretrained(preset, drafter, target, vae, reward, text_encoder, reward_tokenizer,
                                   drafter_device, target_device), backend, engines)

    def resolve(self, options: GenerationOptions) -> GenerationOptions:
        """The options with this pipeline's defaults filled in (num_blocks from the preset, backend)."""
        options = options.resolved(self.preset.video.num_blocks)
        return options if options.backend is not None else options.replace(backend=self.default_backend)

    def run(self, prompt: str, options: GenerationOptions, threaded: bool = True) -> BlockStream:
        """The blocks of one video for explicit options (what `stream` and `__call__` call)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        opts = self.resolve(options)
        runners = self.runners(opts.backend)
        report = LoopReport()
        if opts.scheduler == "cpp":
            from sdvg.generation.native import generate_blocks_native

            blocks = generate_blocks_native(self.components, prompt, opts, report, runners=runners,
                                            threaded=threaded)
        else:
            from sdvg.generation.reference import generate_blocks

            blocks = generate_blocks(self.components, prompt, opts, report, runners=runners)
        return BlockStream(blocks, RunStats(prompt, self.preset.name, opts), report)

    def stream(self, prompt: str, *, mode: str = D.mode, tau: float = D.tau, num_blocks: int | None = D.num_blocks,
               seed: int = D.seed, router: str = D.router, accept_prob: float = D.accept_prob,
               pattern=D.pattern, aggregation: str = D.aggregation, force_first_reject: bool = D.force_first_reject,
               drafter_context: str = D.drafter_context, skip_first_draft: bool = D.skip_first_draft,
               lazy_target_commit: bool = D.lazy_target_commit, score_emitted: bool = D.score_emitted,
               scheduler: str = D.scheduler, run_ahead: bool = D.run_ahead, backend: str | None = D.backend
               ) -> BlockStream:
        """Yield each block as soon as its frames are final; the returned stream's `.stats` is
        complete once it is exhausted. The keywords are the generation options
        (`sdvg.options.GenerationOptions`, whose field docs say what each does):

        mode: sdvg | target | draft. tau: acceptance threshold on the draft's aggregated score.
        num_blocks: blocks to generate (None: the preset's). seed: every noise draw.
        router: reward | random | pattern (accept_prob for random; pattern, a 0/1 string or list of
        bools, for pattern). aggregation: min | mean | trimmed_mean | quantile.
        force_first_reject: block 0 from the target. drafter_context: committed | own.
        skip_first_draft, lazy_target_commit, score_emitted: see GenerationOptions.
        scheduler: cpp (native) | reference (the Python oracle; bitwise the same video).
        run_ahead: draft block b+1 while block b is settled (cpp). backend: eager | compile | tensorrt
        (None: the pipeline's)."""
        options = _options(locals())
        return self.run(prompt, options)

    def __call__(self, prompt: str, *, mode: str = D.mode, tau: float = D.tau, num_blocks: int | None = D.num_blocks,
                 seed: int = D.seed, router: str = D.router, accept_prob: float = D.accept_prob,
                 pattern=D.pattern, aggregation: str = D.aggregation, force_first_reject: bool = D.force_first_reject,
                 drafter_context: str = D.drafter_context, skip_first_draft: bool = D.skip_first_draft,
                 lazy_target_commit: bool = D.lazy_target_commit, score_emitted: bool = D.score_emitted,
                 scheduler: str = D.scheduler, run_ahead: bool = D.run_ahead, backend: str | None = D.backend
                 ) -> PipelineOutput:
        """The whole video at once (keywords as for `stream`)."""
        options = _options(locals())
        return self.generate(prompt, options)

    def generate(self, prompt: str, options: GenerationOptions) -> PipelineOutput:
        """The whole video for explicit options. The scheduler runs on this thread (nothing to stream)."""
        stream = self.run(prompt, options, threaded=False)
        blocks = list(stream)
        return PipelineOutput(frames=torch.cat([b.frames for b in blocks]),
                              latents=torch.cat([b.latents for b in blocks], dim=2), stats=stream.stats,
                              blocks=blocks)
