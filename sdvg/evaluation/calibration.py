"""The calibrations behind `sdvg calibrate` and `sdvg calibrate-exit`: tau for a wanted acceptance rate
(re-derived over rounds), tau for a quality goal over a sweep's summary, and the stability verifier's
thresholds for an oracle eps with the k_bar they give (docs/evaluation.md, docs/early-exit.md).

Each takes a ready pipeline (anything with the `SpeculativeVideoPipeline` methods it calls) and
returns the JSON-ready result; `phase(desc, total, unit)` opens a progress bar (a context manager
yielding an object with `update(n)` and `set_postfix(**values)`, as tqdm's), `say(line)` reports."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

from sdvg.evaluation.sweep import calibrate_acceptance, calibrate_retention, retention_formula, retention_goal

ACCEPTANCE_ROUNDS = 3  # re-derivations of tau from the drafts made under the last tau


class _SilentBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values) -> None:
        pass


@contextmanager
def silent_phase(desc: str, total: int, unit: str, initial: int = 0):
    """The default `phase`: no bar."""
    yield _SilentBar()


def _quiet(line: str) -> None:
    pass


# ------------------------------------------------------------------------------- tau for an acceptance rate
def calibrate_for_acceptance(pipe, prompts: list[tuple[int, str]], opts, acceptance: float,
                             say: Callable[[str], None] = _quiet, phase=silent_phase) -> dict:
    """tau whose drafts are accepted at rate `acceptance` (blocks 1..B-1). Round 0 scores every draft
    (tau = -inf, all accepted); each round takes the (1 - a) quantile of the last round's scores as tau
    and generates again under it (a draft can depend on earlier decisions, a score on the VAE's causal
    cache); the round whose achieved acceptance is nearest the goal wins. `prompts`: (index, text).
    `phase`: a progress bar per round over its videos (the module docstring)."""
    own = opts.drafter_context == "own"

    def run_all(tau: float, what: str) -> tuple[list[float], float | None]:
        """Every prompt at tau: the draft scores of blocks 1..B-1 and the mean acceptance."""
        scores, rates = [], []
        with phase(f"calibrate: {what}", len(prompts), "video") as bar:
            for _, prompt in prompts:
                stats = pipe.generate(prompt, opts.replace(tau=tau)).stats
                scores += [b["score"] for b in stats.blocks[1:] if b["score"] is not None]
                rates += [] if stats.acceptance_rate is None else [stats.acceptance_rate]
                bar.update(1)
        return scores, (sum(rates) / len(rates) if rates else None)

    scores, _ = run_all(-math.inf, "every draft scored, all accepted")
    rounds = []
    for _ in range(ACCEPTANCE_ROUNDS):
        tau = calibrate_acceptance(scores, acceptance)
        if any(r["tau"] == tau for r in rounds):
            break
        n_scores = len(scores)
        scores, achieved = run_all(tau, f"check tau={tau:.4f}")
        rounds.append({"tau": tau, "draft_scores": n_scores, "achieved_acceptance": achieved})
        say(f"calibrate: tau={tau:.4f} gives acceptance " + ("n/a" if achieved is None else f"{achieved:.1%}")
            + f" (goal {acceptance:.1%})")
        if achieved is not None and abs(achieved - acceptance) < 1e-9:
            break
    best = min(rounds, key=lambda r: math.inf if r["achieved_acceptance"] is None
               else abs(r["achieved_acceptance"] - acceptance))
    note = ("under --drafter-context own the drafts do not depend on tau; their scores still do, slightly, "
            "through the VAE's causal cache (a draft is decoded after the previous emitted block), so tau was "
            "re-derived from the scores under the previous tau (rounds)"
            if own else
            "under --drafter-context committed a draft depends on the earlier decisions, so the scores shift "
            "with tau; tau was re-derived from the drafts made under the previous tau (rounds)")
    note += "; achieved_acceptance is what the chosen tau gives"
    return {"goal": {"acceptance": acceptance}, "tau": best["tau"], "draft_scores": best["draft_scores"],
            "drafter_context": opts.drafter_context, "drafts_independent_of_tau": own, "note": note,
            "achieved_acceptance": best["achieved_acceptance"], "rounds": rounds, "prompts": len(prompts),
            "options": opts.replace(tau=best["tau"]).as_dict()}


# ---------------------------------------------------------------------------------- tau for a quality goal
def calibrate_for_quality(summary: dict, retention: float | None = None, quality_drop: float | None = None,
                          unpublished_taus: list[float] = ()) -> dict:
    """The fastest swept tau of a sweep's `summary` whose quality retention reaches the goal (exactly one
    of `retention` and `quality_drop`); ValueError naming the goal when none does."""
    best = calibrate_retention(summary, retention=retention, quality_drop=quality_drop)
    positive = summary["quality_positive"]
    return {"goal": {"retention": retention} if retention is not None else {"quality_drop": quality_drop},
            "retention_kind": summary["retention_kind"],
            "least_retention": retention_goal(positive, retention, quality_drop), "tau": best["tau"],
            "achieved": best, "prompts": summary["prompts"],
            "note": f"retention is {summary.get('retention_formula') or retention_formula(positive)}"
                    + (" (the metric is declared positive)" if positive else " (the metric's scores may be negative)"),
            "unpublished_taus": list(unpublished_taus)}


# ------------------------------------------------------------------------- early-exit stability thresholds
def collect_records(pipe, prompts: list[str], seeds: list[int], base, role: str, keep_hidden: bool, what: str,
                    phase=silent_phase):
    """The oracle rollouts of every (prompt, seed) in `role` (`exit_calibration.collect`), one bar tick
    per video."""
    from sdvg.evaluation.exit_calibration import collect

    with phase(what, len(prompts) * len(seeds), "video") as bar:
        return collect(pipe, prompts, seeds, base, role, keep_hidden, progress=lambda done, total: bar.update(1))


def calibrate_exit_thresholds(pipe, prompts: list[str], seeds: list[int], base, role: str, min_precision: float,
                              rule: str, source: dict | None = None, phase=silent_phase) -> dict:
    """Oracle rollouts -> (tau_red, tau_stab) for `base.exit_eps` by `rule`, the per-step report, then
    every video generated with those thresholds for the k_bar they give. The result names the flags
    that use them; `source` (what identifies the prompts) is recorded beside the prompt count."""
    from sdvg.evaluation.exit_calibration import calibrate, measure_mean_steps, role_mode

    records = collect_records(pipe, prompts, seeds, base, role, False, "oracle rollouts", phase)
    result = calibrate(records, base.exit_eps, min_precision, rule)
    with phase("generate with the thresholds", len(prompts) * len(seeds), "video") as bar:
        measured = measure_mean_steps(pipe, prompts, seeds, base, role, tuple(result["thresholds"]),
                                      progress=lambda done, total: bar.update(1))
    red, stab = result["thresholds"]
    flags = (f"--mode {role_mode(role)} --early-exit {role} --exit-verifier stability "
             f"--exit-thresholds {red!r},{stab!r}")
    return {"role": role, **result, "measured_mean_steps": measured["mean_steps"],
            "measured_per_video": measured["per_video"], "flags": flags, "seeds": seeds,
            "prompt_count": len(prompts), **(source or {}),
            "options": base.replace(mode=role_mode(role), early_exit=role).as_dict(),
            "provenance": pipe.provenance()}
