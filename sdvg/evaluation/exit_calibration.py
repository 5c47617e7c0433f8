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
    measured k_bar (the stats' `result.mean_steps`) per video and their mean."""
    per_video = []
    jobs = [(p, s) for p in prompts for s in seeds]
    for n, (prompt, seed) in enumerate(jobs):
        opts = role_options(base, role, seed, exit_verifier="stability", exit_thresholds=tuple(thresholds))
        per_video.append(float(pipe.generate(prompt, opts).stats.exit_summary()["mean_steps"]))
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
    """The head's weights and Adam's state tensors in one safetensors file; the step, the losses and the
    config as JSON in its metadata (no pickle). Written through a temporary file created O_EXCL |
    O_NOFOLLOW and a rename; a state holding NaN or inf is refused (ValueError) and the previous
    checkpoint kept."""
    import json
    from dataclasses import asdict

    from safetensors.torch import save

    from sdvg.io.safe_files import write_bytes_atomic

    opt = state.optimizer.state_dict()
    tensors = {f"head.{k}": v.detach().float().contiguous().cpu() for k, v in state.head.state_dict().items()}
    for idx, slots in opt["state"].items():
        for name, value in slots.items():
            tensors[f"adam.{idx}.{name}"] = torch.as_tensor(value).detach().float().contiguous().cpu()
    bad = [k for k, v in tensors.items() if not bool(torch.isfinite(v).all())]
    if bad or not all(math.isfinite(x) for x in state.losses):
        raise ValueError(f"training state at step {state.step} holds NaN or inf ({', '.join(bad[:3]) or 'losses'}); "
                         f"checkpoint {path} not written (the previous one is kept); lower --lr")
    meta = {"format": CHECKPOINT_FORMAT, "step": str(state.step), "losses": json.dumps(state.losses),
            "param_groups": json.dumps(opt["param_groups"]), "config": json.dumps(asdict(config)),
            "head_config": json.dumps({"dim": state.head.config.dim}), "extra": json.dumps(extra or {})}
    write_bytes_atomic(path, save(tensors, metadata=meta), f"checkpoint {path}")


CHECKPOINT_KEYS = {"format", "step", "losses", "param_groups", "config", "head_config", "extra"}
MAX_TRAIN_STEPS = 10_000_000


def _open_safetensors(path, what: str, fix: str) -> tuple[dict, dict]:
    """(metadata, {name: (dtype, shape)}) of a safetensors file without reading a tensor; a file that is not
    one (truncated, foreign) is refused with `fix`."""
    from pathlib import Path

    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"{what} {path} is not a file; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            info = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
        raise ValueError(f"{what} {path} is not a readable safetensors file ({str(exc)[:160]}); {fix}") from None
    return meta, info


def _read_tensors(path, what: str, fix: str) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{what} {path} cannot be read ({str(exc)[:160]}); {fix}") from None


def load_checkpoint(path, config: TrainConfig, dim: int | None = None) -> tuple[TrainState, dict]:
    """A TrainState from `save_checkpoint`'s file (and its `extra`), validated before use as untrusted
    input: known metadata keys, bounded JSON, the config (but for `steps` and `checkpoint_every`) and the
    head's width (`dim`, the records' hidden width, when given) as now, the step an integer in [0,
    config.steps] with as many finite losses, every tensor named, shaped and finite as the head and Adam
    expect. The optimizer's settings come from `config` (the saved ones are not read). ValueError
    naming the value otherwise; nothing is written."""
    from dataclasses import asdict

    from sdvg.bounded import quote
    from sdvg.models.exit_head import MAX_DIM, read_metadata_json

    fix = "move it away (or pass another --out) to train afresh"
    what = "checkpoint"
    meta, info = _open_safetensors(path, what, fix)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not an exit-head training checkpoint (format {quote(meta.get('format'))}); "
                         f"{fix}")
    unknown = sorted(set(meta) - CHECKPOINT_KEYS)
    missing = sorted(CHECKPOINT_KEYS - {"extra", "param_groups"} - set(meta))
    if unknown or missing:
        raise ValueError(f"checkpoint {path}: metadata keys unknown {[k[:40] for k in unknown[:5]]}, missing "
                         f"{missing}; {fix}")
    source = f"checkpoint {path}"
    saved = read_metadata_json(meta, "config", source)
    if not isinstance(saved, dict):
        raise ValueError(f"{source}: config metadata {quote(saved)} is not a mapping; {fix}")
    differ = sorted(k for k, v in asdict(config).items()
                    if k not in ("steps", "checkpoint_every") and saved.get(k) != v)
    if differ:
        raise ValueError(f"checkpoint {path} was trained with other settings ("
                         + ", ".join(f"{k}={quote(saved.get(k))} now {getattr(config, k)!r}" for k in differ)
                         + "); give the same ones or another --out")
    head_config = read_metadata_json(meta, "head_config", source)
    saved_dim = head_config.get("dim") if isinstance(head_config, dict) else None
    if isinstance(saved_dim, bool) or not isinstance(saved_dim, int) or not 1 <= saved_dim <= MAX_DIM:
        raise ValueError(f"{source}: head width {quote(saved_dim)} must be an integer in [1, {MAX_DIM}]; {fix}")
    if dim is not None and saved_dim != dim:
        raise ValueError(f"{source}: a head of width {saved_dim}, but the records' hidden width is {dim}; {fix}")
    step_text = meta["step"]
    if not (isinstance(step_text, str) and step_text.isdigit() and len(step_text) <= 9):
        raise ValueError(f"{source}: step {quote(step_text)} must be a non-negative integer; {fix}")
    step = int(step_text)
    if step > config.steps:
        raise ValueError(f"{source} is at step {step}, past --steps {config.steps}; pass --steps {step} or more to "
                         f"continue it, or {fix}")
    losses = read_metadata_json(meta, "losses", source)
    if not isinstance(losses, list) or len(losses) != step or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in losses):
        raise ValueError(f"{source}: losses must be {step} finite numbers (one per step done); {fix}")
    extra = read_metadata_json(meta, "extra", source, {})
    if not isinstance(extra, dict):
        raise ValueError(f"{source}: extra metadata is not a mapping; {fix}")

    state = new_state(saved_dim, config)
    params = list(state.head.parameters())
    want = {f"head.{k}": tuple(v.shape) for k, v in state.head.state_dict().items()}
    if step > 0:
        for i, p in enumerate(params):
            want[f"adam.{i}.step"] = ()
            want[f"adam.{i}.exp_avg"] = tuple(p.shape)
            want[f"adam.{i}.exp_avg_sq"] = tuple(p.shape)
    got = {k: shape for k, (_, shape) in info.items()}
    if want != got:
        missing_t, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"{source} does not hold this head's training state: missing {missing_t[:4]}, unexpected "
                         f"{[k[:40] for k in unexpected[:4]]}, wrong shapes {wrong[:4]}; {fix}")
    tensors = _read_tensors(path, what, fix)
    for k, v in tensors.items():
        if not v.is_floating_point() or not bool(torch.isfinite(v).all()):
            raise ValueError(f"{source}: tensor {k} is not finite floating point (NaN or inf: a diverged or damaged "
                             f"run); {fix}")
        if k.endswith(".exp_avg_sq") and bool((v < 0).any()):
            raise ValueError(f"{source}: tensor {k} holds negative second moments; {fix}")
        if k.endswith(".step") and not (0 <= float(v) <= step and float(v) == int(float(v))):
            raise ValueError(f"{source}: tensor {k} = {float(v):g} must be a whole number of steps in [0, {step}]; "
                             f"{fix}")
    state.head.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
    slots: dict = {}
    for k, v in tensors.items():
        if k.startswith("adam."):
            _, idx, name = k.split(".", 2)
            slots.setdefault(int(idx), {})[name] = v
    groups = state.optimizer.state_dict()["param_groups"]  # this config's settings, not the file's
    state.optimizer.load_state_dict({"state": slots, "param_groups": groups})
    state.step, state.losses = step, [float(x) for x in losses]
    return state, extra


def save_records(path, records: Records, meta: dict) -> None:
    """Records (with their hidden states) as safetensors; `meta` (what produced them) as JSON metadata.
    Written through a temporary file created O_EXCL | O_NOFOLLOW and a rename."""
    import json

    from safetensors.torch import save

    from sdvg.io.safe_files import write_bytes_atomic

    tensors = {"scores": records.scores, "gaps": records.gaps, "steps": records.steps, "blocks": records.blocks,
               "videos": records.videos}
    if records.hidden is not None:
        tensors["hidden"] = records.hidden
    data = save({k: v.contiguous() for k, v in tensors.items()},
                metadata={"grid": json.dumps(list(records.grid)), "num_steps": str(records.num_steps),
                          "meta": json.dumps(meta)})
    write_bytes_atomic(path, data, f"records {path}")


RECORD_KEYS = {"scores", "gaps", "steps", "blocks", "videos", "hidden"}


def load_records(path) -> tuple[Records, dict]:
    """Records from `save_records`'s file, validated as untrusted input: the tensors named, typed and shaped
    alike ([N, S] scores and gaps, [N] steps, blocks, videos, [N, S, dim] hidden), the grid three positive
    integers whose product is S, steps in [0, num_steps), gaps finite and >= 0, scores not NaN, hidden
    finite; metadata bounded JSON. ValueError naming the value otherwise (the caller records again)."""
    from sdvg.bounded import quote
    from sdvg.models.exit_head import MAX_DIM, read_metadata_json

    fix = "move it away (or run without --resume) to record again"
    meta, info = _open_safetensors(path, "records", fix)
    source = f"records {path}"
    if set(meta) != {"grid", "num_steps", "meta"}:
        raise ValueError(f"{source}: metadata keys {sorted(k[:40] for k in meta)[:6]} are not a records file's; {fix}")
    grid = read_metadata_json(meta, "grid", source)
    if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and not isinstance(g, bool)
                                                               and 1 <= g <= 1 << 16 for g in grid)):
        raise ValueError(f"{source}: grid {quote(grid)} must be three positive integers; {fix}")
    text = meta["num_steps"]
    if not (text.isdigit() and 1 <= int(text[:6]) <= 1000 and len(text) <= 4):
        raise ValueError(f"{source}: num_steps {quote(text)} must be an integer in [1, 1000]; {fix}")
    num_steps = int(text)
    extra = read_metadata_json(meta, "meta", source)
    missing, unknown = sorted(RECORD_KEYS - {"hidden"} - set(info)), sorted(set(info) - RECORD_KEYS)
    if missing or unknown:
        raise ValueError(f"{source}: tensors missing {missing}, unknown {[k[:40] for k in unknown[:4]]}; {fix}")
    s = grid[0] * grid[1] * grid[2]
    n = info["steps"][1][0] if len(info["steps"][1]) == 1 else -1
    want = {"scores": (n, s), "gaps": (n, s), "steps": (n,), "blocks": (n,), "videos": (n,)}
    if "hidden" in info:
        shape = info["hidden"][1]
        if len(shape) != 3 or shape[:2] != (n, s) or not 1 <= shape[2] <= MAX_DIM:
            raise ValueError(f"{source}: hidden has shape {list(shape)[:4]}, expected [{n}, {s}, dim <= {MAX_DIM}]; "
                             f"{fix}")
    wrong = [k for k, shp in want.items() if info[k][1] != shp]
    if n < 0 or wrong:
        raise ValueError(f"{source}: tensors {wrong or ['steps']} do not have aligned shapes ({n} rows of {s} "
                         f"tokens); {fix}")
    t = _read_tensors(path, "records", fix)
    for k in ("steps", "blocks", "videos"):
        if t[k].dtype != torch.int64 or bool((t[k] < 0).any()):
            raise ValueError(f"{source}: {k} must be non-negative int64; {fix}")
    if bool((t["steps"] >= num_steps).any()):
        raise ValueError(f"{source}: a step index is >= num_steps {num_steps}; {fix}")
    for k in ("scores", "gaps", "hidden"):
        if k in t and not t[k].is_floating_point():
            raise ValueError(f"{source}: {k} must be floating point; {fix}")
    if not bool(torch.isfinite(t["gaps"]).all()) or bool((t["gaps"] < 0).any()):
        raise ValueError(f"{source}: gaps must be finite and >= 0; {fix}")
    if bool(torch.isnan(t["scores"]).any()):
        raise ValueError(f"{source}: scores hold NaN; {fix}")
    if "hidden" in t and not bool(torch.isfinite(t["hidden"]).all()):
        raise ValueError(f"{source}: hidden states hold NaN or inf; {fix}")
    return (Records(t["scores"].float(), t["gaps"].float(), t["steps"], t["blocks"], t["videos"], tuple(grid),
                    num_steps, None if "hidden" not in t else t["hidden"].float()), extra)


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
