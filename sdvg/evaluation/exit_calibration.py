"""Calibration of the early-exit verifiers (docs/early-exit.md): recorded rollouts, the stability
thresholds picked for an oracle eps, and the learned exit head trained on the same records.

Collection runs the reference loop with a recording verifier in the role that exits early: at each
block it first runs the full schedule (the oracle's rollout: rel_k of every token), then lets the
block denoise densely (nothing exits, so the video is the plain one) while recording, at every judged
step k < K, the stability verifier's smoothed scores, the oracle gaps and (for the head) the last
transformer block's hidden states. Selection and metrics are pure functions over those arrays."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sdvg.generation.early_exit.oracle import relative_gaps
from sdvg.generation.early_exit.stability import StabilityVerifier
from sdvg.generation.early_exit.view import BlockContext, StepView

RULES = ("precision", "f1")


# ------------------------------------------------------------------------------------------ collection
class RecordingVerifier:
    """Never lets a token exit; records (smoothed stability score, oracle gap[, hidden]) per judged step."""

    name = "record"

    def __init__(self, keep_hidden: bool = False):
        self.needs_hidden = keep_hidden
        self.stability = StabilityVerifier(0.0, 0.0)
        self.rows: list[dict] = []  # one per (block, judged step)
        self.video = 0
        self.rollouts = 0
        self._gaps: torch.Tensor | None = None  # [K, S] of the current block
        self._block = 0

    def start(self, ctx: BlockContext) -> None:
        self.stability.start(ctx)
        x0s = ctx.rollout()
        self.rollouts = len(x0s)
        self._gaps = relative_gaps(x0s, ctx.patch).cpu()
        self._block = ctx.block

    def converged(self, view: StepView) -> torch.Tensor:
        if view.active.numel() != math.prod(view.grid):
            raise RuntimeError("the recording verifier expects dense steps (it never lets a token exit)")
        self.rows.append({"video": self.video, "block": self._block, "step": view.step, "grid": view.grid,
                          "score": self.stability.smoothed(view).float().cpu(),  # [S]
                          "gap": self._gaps[view.step].float(),  # [S]
                          "hidden": None if view.hidden is None else view.hidden.float().cpu()})  # [S, dim]
        return torch.zeros(view.active.shape, dtype=torch.bool, device=view.active.device)


@dataclass(frozen=True)
class Records:
    """Aligned per-step records of rollouts: row n is one judged step (0-based `steps[n]`, k = step + 1)
    of one block of one video."""

    scores: torch.Tensor  # [N, S] float32: the stability verifier's smoothed score (inf: no history)
    gaps: torch.Tensor  # [N, S] float32: the oracle's rel_k
    steps: torch.Tensor  # [N] int64
    blocks: torch.Tensor  # [N] int64
    videos: torch.Tensor  # [N] int64
    grid: tuple[int, int, int]  # (F, gh, gw), S = F * gh * gw
    num_steps: int  # K of the role's schedule
    hidden: torch.Tensor | None = None  # [N, S, dim] float32 (for the head)

    def __len__(self) -> int:
        return int(self.steps.numel())


def role_mode(role: str) -> str:
    if role not in ("target", "drafter"):
        raise ValueError(f"unknown role {role!r}; choose target or drafter")
    return "target" if role == "target" else "draft"


def role_options(base, role: str, seed: int, **exit_opts):
    """`base` options with the single-role mode of `role`, early exit in it and `seed`."""
    return base.replace(mode=role_mode(role), early_exit=role, seed=seed, **exit_opts)


def collect(pipe, prompts: list[str], seeds: list[int], base, role: str, keep_hidden: bool = False,
            progress=None) -> Records:
    """Record every (prompt, seed) video of `role` (single-role mode, the reference loop). `pipe` is a
    SpeculativeVideoPipeline; `base` the generation options (mode, early exit and seed are set here);
    `progress(done, total)` after each video."""
    from sdvg.generation.reference import generate_blocks

    rec = RecordingVerifier(keep_hidden)
    jobs = [(p, s) for p in prompts for s in seeds]
    for v, (prompt, seed) in enumerate(jobs):
        opts = pipe.resolve(role_options(base, role, seed, exit_verifier="oracle"))
        rec.video = v
        for _ in generate_blocks(pipe.components, prompt, opts, runners=pipe.runners(opts.backend),
                                 memory_budget_gib=pipe.memory_budget_gib, exit_verifiers={role: rec}):
            pass
        if progress is not None:
            progress(v + 1, len(jobs))
    if not rec.rows:
        raise ValueError("the rollouts recorded no step (a schedule of one step has nothing to judge)")
    rows = rec.rows
    return Records(torch.stack([r["score"] for r in rows]), torch.stack([r["gap"] for r in rows]),
                   torch.tensor([r["step"] for r in rows]), torch.tensor([r["block"] for r in rows]),
                   torch.tensor([r["video"] for r in rows]), tuple(rows[0]["grid"]), _schedule_steps(pipe, base, role),
                   torch.stack([r["hidden"] for r in rows]) if keep_hidden else None)


def _schedule_steps(pipe, base, role: str) -> int:
    from sdvg.generation.prepare import role_schedule

    opts = pipe.resolve(role_options(base, role, 0))
    return role_schedule(pipe.preset, opts.role_context(role)).num_steps


# ---------------------------------------------------------------------------------------------- metrics
def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x` [N], ties sharing their average rank (infinities allowed, NaN refused)."""
    x = np.asarray(x, dtype=np.float64)
    if np.isnan(x).any():
        raise ValueError("ranks of NaN scores are undefined")
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    starts = np.r_[0, np.flatnonzero(xs[1:] != xs[:-1]) + 1]
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + 1 + ends) / 2.0, ends - starts)
    return ranks


def auroc(scores, positives) -> float | None:
    """Area under the ROC curve of `scores` [N] (higher = more likely positive) for bool `positives` [N]:
    P(score of a positive > score of a negative) + P(tie) / 2 (Mann-Whitney, average ranks). None when
    either class is empty."""
    scores, positives = np.asarray(scores, dtype=np.float64), np.asarray(positives, dtype=bool)
    n_pos = int(positives.sum())
    n_neg = len(positives) - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    u = average_ranks(scores)[positives].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def precision_recall(scores, positives, tau: float) -> dict:
    """What `score < tau` (strict, as the verifier) gives: precision, recall (None when undefined) and the
    share of tokens that exit."""
    scores, positives = np.asarray(scores, dtype=np.float64), np.asarray(positives, dtype=bool)
    exits = scores < tau
    tp = int((exits & positives).sum())
    return {"precision": tp / int(exits.sum()) if exits.any() else None,
            "recall": tp / int(positives.sum()) if positives.any() else None,
            "exit_share": float(exits.mean()) if len(exits) else None}


def select_threshold(scores, positives, min_precision: float = 0.95, rule: str = "precision") -> float:
    """The threshold tau for `score < tau` on the records `scores` [N], `positives` [N] (converged).

    Candidates cut between consecutive distinct finite scores (the midpoint; just above the largest).
    rule `precision`: the largest candidate whose precision is >= `min_precision` (the most exits at that
    precision); `f1`: the candidate of the largest F1 (the largest such on ties). 0.0 (nothing exits)
    when no candidate qualifies."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    scores, positives = np.asarray(scores, dtype=np.float64), np.asarray(positives, dtype=bool)
    finite = np.isfinite(scores)
    s, p = scores[finite], positives[finite]
    if len(s) == 0:
        return 0.0
    order = np.argsort(s, kind="mergesort")
    s, p = s[order], p[order]
    last = np.r_[np.flatnonzero(s[1:] != s[:-1]), len(s) - 1]  # the last index of each distinct value
    values = s[last]
    taus = np.r_[(values[:-1] + values[1:]) / 2.0, np.nextafter(values[-1], np.inf)]
    tp = np.cumsum(p)[last].astype(np.float64)
    predicted = (last + 1).astype(np.float64)
    precision = tp / predicted
    if rule == "precision":
        ok = np.flatnonzero(precision >= min_precision)
        return float(taus[ok[-1]]) if len(ok) else 0.0
    total_pos = int(positives.sum())  # recall counts the non-finite scores' positives too
    if total_pos == 0:
        return 0.0
    f1 = 2 * tp / (predicted + total_pos)
    best = np.flatnonzero(f1 == f1.max())[-1]
    return float(taus[best]) if f1[best] > 0 else 0.0


def first_exit_steps(passes: torch.Tensor, records: Records) -> torch.Tensor:
    """k*(i) of every (video, block) token when a token exits at its first judged step that `passes`
    [N, S] (bool): [M, S] int64 in 1..K, one row per recorded block (tokens never passing take K)."""
    keys = (records.videos * (int(records.blocks.max()) + 1) + records.blocks).tolist()
    blocks: dict[int, torch.Tensor] = {}
    for n, key in enumerate(keys):
        k = blocks.setdefault(key, torch.full((passes.shape[1],), records.num_steps, dtype=torch.long))
        hit = passes[n] & (k == records.num_steps)
        k[hit] = torch.minimum(k[hit], torch.full_like(k[hit], int(records.steps[n]) + 1))
    return torch.stack(list(blocks.values()))


def calibrate(records: Records, eps: float, min_precision: float = 0.95, rule: str = "precision") -> dict:
    """(tau_red, tau_stab) for `eps` and the per-step report. tau_red from the records of step k = 1
    (redundancy), tau_stab from those of k = 2..K-1 pooled (one threshold for every later step, as the
    verifier reads it). Labels: converged = rel_k < eps."""
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps {eps} must be a finite number >= 0")
    scores, labels = records.scores.numpy(), (records.gaps < eps).numpy()
    first = (records.steps == 0).numpy()
    later = ~first
    tau_red = select_threshold(scores[first].ravel(), labels[first].ravel(), min_precision, rule)
    tau_stab = select_threshold(scores[later].ravel(), labels[later].ravel(), min_precision, rule) \
        if later.any() else 0.0
    steps = []
    for step in sorted(set(records.steps.tolist())):
        rows = (records.steps == step).numpy()
        s, y = scores[rows].ravel(), labels[rows].ravel()
        tau = tau_red if step == 0 else tau_stab
        steps.append({"k": step + 1, "score": "redundancy" if step == 0 else "stability", "tokens": int(len(s)),
                      "converged_share": float(y.mean()), "no_history_tokens": int((~np.isfinite(s)).sum()),
                      "auroc": auroc(-s, y), "threshold": tau, **precision_recall(s, y, tau)})
    taus = torch.where(records.steps == 0, tau_red, tau_stab)[:, None]  # [N, 1]
    predicted = first_exit_steps(records.scores < taus, records)
    oracle = first_exit_steps(records.gaps < eps, records)
    return {"eps": eps, "rule": rule, "min_precision": min_precision if rule == "precision" else None,
            "thresholds": [tau_red, tau_stab], "steps": steps,
            "dense_mean_steps": float(predicted.float().mean()),
            "oracle_mean_steps": float(oracle.float().mean()), "num_steps": records.num_steps,
            "records": {"rows": len(records), "tokens_per_block": int(records.scores.shape[1]),
                        "videos": int(records.videos.max()) + 1}}


def measure_mean_steps(pipe, prompts: list[str], seeds: list[int], base, role: str,
                       thresholds: tuple[float, float], progress=None) -> dict:
    """Generate every (prompt, seed) video with the stability verifier at `thresholds` in `role`; the
    measured k_bar (`mean_steps` of the stats) per video and their mean."""
    per_video = []
    jobs = [(p, s) for p in prompts for s in seeds]
    for n, (prompt, seed) in enumerate(jobs):
        opts = role_options(base, role, seed, exit_verifier="stability", exit_thresholds=tuple(thresholds))
        per_video.append(float(pipe.generate(prompt, opts).stats.get("mean_steps")))
        if progress is not None:
            progress(n + 1, len(jobs))
    return {"mean_steps": sum(per_video) / len(per_video), "per_video": per_video}


# --------------------------------------------------------------------------------------------- the head
CHECKPOINT_FORMAT = "sdvg-exit-head-checkpoint"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps in all (a resumed run continues up to this)
    batch_size: int = 4
    lr: float = 1e-3
    seed: int = 0  # the head's initial weights and every batch draw
    checkpoint_every: int = 100


@dataclass
class TrainState:
    head: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: int  # optimizer steps done
    losses: list  # the training loss of each step (its batch)


def new_state(dim: int, config: TrainConfig) -> TrainState:
    from sdvg.models.exit_head import ExitHead, ExitHeadConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        head = ExitHead(ExitHeadConfig(dim))
    return TrainState(head, torch.optim.Adam(head.parameters(), lr=config.lr), 0, [])


def batch_indices(n: int, step: int, config: TrainConfig) -> torch.Tensor:
    """The rows of step `step`'s batch: drawn from (seed, step) alone, so a resumed run draws the same."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    return torch.randint(n, (config.batch_size,), generator=gen)


def head_loss(head, hidden: torch.Tensor, gaps: torch.Tensor, grid) -> torch.Tensor:
    """Smooth-L1 of the predicted against the oracle rel_k: hidden [B, S, dim], gaps [B, S]."""
    pred = head(hidden, grid).flatten(1)  # [B, S]
    return torch.nn.functional.smooth_l1_loss(pred, gaps)


@torch.no_grad()
def predict(head, records: Records, chunk: int = 16) -> torch.Tensor:
    """The head's predicted rel_k of every record row [N, S]."""
    return torch.cat([head(records.hidden[i:i + chunk], records.grid).flatten(1)
                      for i in range(0, len(records), chunk)])


@torch.no_grad()
def dataset_loss(head, records: Records) -> float:
    return float(torch.nn.functional.smooth_l1_loss(predict(head, records), records.gaps))


def train(state: TrainState, records: Records, config: TrainConfig, progress=None, checkpoint=None) -> TrainState:
    """Adam steps on batches of `config.batch_size` record rows (every judged step, one head) from
    `state.step` up to `config.steps`; `progress(step, loss)` after each, `checkpoint(state)` every
    `config.checkpoint_every` steps and at the end."""
    if records.hidden is None:
        raise ValueError("training the head needs records with hidden states (collect(keep_hidden=True))")
    state.head.train()
    while state.step < config.steps:
        idx = batch_indices(len(records), state.step, config)
        loss = head_loss(state.head, records.hidden[idx], records.gaps[idx], records.grid)
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.step += 1
        state.losses.append(float(loss.detach()))
        if progress is not None:
            progress(state.step, state.losses[-1])
        if checkpoint is not None and (state.step % config.checkpoint_every == 0 or state.step == config.steps):
            checkpoint(state)
    state.head.eval()
    return state


def save_checkpoint(path, state: TrainState, config: TrainConfig, extra: dict | None = None) -> None:
    """The head's weights and Adam's state tensors in one safetensors file; the step, the losses, the
    optimizer's scalar settings and the config as JSON in its metadata (no pickle)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from safetensors.torch import save_file

    opt = state.optimizer.state_dict()
    tensors = {f"head.{k}": v.detach().float().contiguous().cpu() for k, v in state.head.state_dict().items()}
    for idx, slots in opt["state"].items():
        for name, value in slots.items():
            tensors[f"adam.{idx}.{name}"] = torch.as_tensor(value).detach().float().contiguous().cpu()
    meta = {"format": CHECKPOINT_FORMAT, "step": str(state.step), "losses": json.dumps(state.losses),
            "param_groups": json.dumps(opt["param_groups"]), "config": json.dumps(asdict(config)),
            "head_config": json.dumps({"dim": state.head.config.dim}), "extra": json.dumps(extra or {})}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def load_checkpoint(path, config: TrainConfig) -> tuple[TrainState, dict]:
    """A TrainState from `save_checkpoint`'s file (and its `extra`); the config must match but for `steps`
    and `checkpoint_every`."""
    import json
    from dataclasses import asdict

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not an exit-head training checkpoint (format {meta.get('format')!r})")
    saved = json.loads(meta["config"])
    differ = sorted(k for k, v in asdict(config).items()
                    if k not in ("steps", "checkpoint_every") and saved.get(k) != v)
    if differ:
        raise ValueError(f"checkpoint {path} was trained with other settings ("
                         + ", ".join(f"{k}={saved.get(k)!r} now {getattr(config, k)!r}" for k in differ)
                         + "); give the same ones or another --out")
    state = new_state(int(json.loads(meta["head_config"])["dim"]), config)
    state.head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
    slots: dict = {}
    for k, v in tensors.items():
        if k.startswith("adam."):
            _, idx, name = k.split(".", 2)
            slots.setdefault(int(idx), {})[name] = v
    state.optimizer.load_state_dict({"state": slots, "param_groups": json.loads(meta["param_groups"])})
    state.step, state.losses = int(meta["step"]), json.loads(meta["losses"])
    return state, json.loads(meta.get("extra", "{}"))


def save_records(path, records: Records, meta: dict) -> None:
    """Records (with their hidden states) as safetensors; `meta` (what produced them) as JSON metadata."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    tensors = {"scores": records.scores, "gaps": records.gaps, "steps": records.steps, "blocks": records.blocks,
               "videos": records.videos}
    if records.hidden is not None:
        tensors["hidden"] = records.hidden
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"grid": json.dumps(list(records.grid)), "num_steps": str(records.num_steps),
                        "meta": json.dumps(meta)})
    tmp.replace(path)


def load_records(path) -> tuple[Records, dict]:
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in f.keys()}
    return (Records(t["scores"], t["gaps"], t["steps"], t["blocks"], t["videos"], tuple(json.loads(meta["grid"])),
                    int(meta["num_steps"]), t.get("hidden")), json.loads(meta["meta"]))


def evaluate_head(head, records: Records, eps: float) -> dict:
    """Per judged step on (held-out) records: the head's AUROC beside the stability verifier's (labels
    rel_k < eps; lower score = converged for both), the head's precision and recall at `pred < eps`, and
    its smooth-L1 loss."""
    pred = predict(head, records).numpy()
    labels = (records.gaps < eps).numpy()
    scores = records.scores.numpy()
    steps = []
    for step in sorted(set(records.steps.tolist())):
        rows = (records.steps == step).numpy()
        y = labels[rows].ravel()
        steps.append({"k": step + 1, "tokens": int(len(y)), "converged_share": float(y.mean()),
                      "head_auroc": auroc(-pred[rows].ravel(), y),
                      "stability_auroc": auroc(-scores[rows].ravel(), y),
                      "head": precision_recall(pred[rows].ravel(), y, eps)})
    return {"eps": eps, "loss": dataset_loss(head, records), "steps": steps,
            "head_auroc": auroc(-pred.ravel(), labels.ravel())}
