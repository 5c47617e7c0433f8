"""What one early-exit denoise did: each token's step count and the model calls it made."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExitRecord:
    """One denoise of one block by one role under early exit.

    `steps` [F, gh, gw] int: k*(i), the forward passes token i took (1..num_steps); `forwards`: the
    model calls made (a step with no active token left is not called; an oracle verifier's full
    rollout is counted apart, in `oracle_forwards`); `token_evals`: sum of k*(i), the query tokens
    computed over the denoising steps."""

    role: str
    block: int
    verifier: str
    num_steps: int  # K: the schedule's model calls
    steps: torch.Tensor  # int16 [F, gh, gw], on the CPU
    forwards: int
    oracle_forwards: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.steps.numel())

    @property
    def token_evals(self) -> int:
        return int(self.steps.sum())

    @property
    def mean_steps(self) -> float:
        return float(self.steps.double().mean())

    @property
    def max_steps(self) -> int:
        return int(self.steps.max())

    def exit_fractions(self) -> list[float]:
        """Share of the block's tokens leaving at step k = 1..K."""
        counts = torch.bincount(self.steps.flatten().long(), minlength=self.num_steps + 1)[1:]
        return [float(c) / self.num_tokens for c in counts.tolist()]

    def stats(self) -> dict:
        return {"role": self.role, "verifier": self.verifier, "num_steps": self.num_steps,
                "mean_steps": self.mean_steps, "max_steps": self.max_steps, "exit_fractions": self.exit_fractions(),
                "forwards": self.forwards, "oracle_forwards": self.oracle_forwards, "token_evals": self.token_evals,
                "tokens": self.num_tokens}


@dataclass(frozen=True)
class BlockExits:
    """The early-exit view of one emitted block: the records of the denoises made for it, and the step
    counts of the emitted latents (the producer's record, or its full schedule without early exit)."""

    records: dict  # role -> ExitRecord of this block (drafter: its draft; target: when it ran)
    producer: str  # the role whose latents were emitted
    mean_steps: float
    max_steps: int

    def stats(self) -> dict:
        return {"mean_steps": self.mean_steps, "max_steps": self.max_steps,
                "exit": {"producer": self.producer, **{role: r.stats() for role, r in self.records.items()}}}

    @property
    def steps_map(self) -> torch.Tensor | None:
        """k*(i) [F, gh, gw] of the emitted latents (None when the producer did not exit early)."""
        rec = self.records.get(self.producer)
        return None if rec is None else rec.steps


def block_exits(drafter, target, index: int, decision: str) -> BlockExits | None:
    """The BlockExits of emitted block `index` (None when no role of the video exits early). `drafter` /
    `target`: the video's RoleModels (or None)."""
    if not any(m is not None and m.exit_verifier is not None for m in (drafter, target)):
        return None
    records = {}
    if drafter is not None and index in drafter.exit_records and decision != "target":
        records["drafter"] = drafter.exit_records[index]
    if target is not None and index in target.exit_records and decision in ("forced", "rejected", "target"):
        records["target"] = target.exit_records[index]
    producer_model = drafter if decision in ("accepted", "draft") else target
    producer = producer_model.role
    rec = records.get(producer)
    if rec is not None:
        return BlockExits(records, producer, rec.mean_steps, rec.max_steps)
    k = producer_model.schedule.num_steps
    return BlockExits(records, producer, float(k), k)
