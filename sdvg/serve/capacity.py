"""The batched worker's capacity: what a round of n sessions costs, measured, and the frame rate it predicts.

Every round of the batched worker (sdvg/serve/sessions.py) makes one block of each of its n sessions in
`seconds`; its sessions then play `frames` frames each. The cost of a round is fitted as a line,
`seconds = fixed + per_session * n`, by least squares over the last `window` rounds (their acceptance mix
included: a rejected block's target call is in the seconds it took). With rounds of one size only, the
line goes through the origin (`per_session = seconds / n`), which is what n sessions run one after another
would cost: batching only does better, so the prediction errs on the safe side until rounds of other sizes
are seen. `--min-session-fps` (`ServeConfig.min_session_fps`) admits a session only while the prediction
for one more keeps every admitted session at that rate; a session that would not fit waits in the queue,
told why, and the first one always runs (nothing starves: the queue is first come, first served).
"""
from __future__ import annotations

import collections


class CapacityModel:
    """Round costs against sessions per round (see the module docstring). Used from the worker and, under the
    manager's lock, from `admit`: the caller serializes."""

    def __init__(self, window: int = 64):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.rounds: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=window)

    def observe(self, sessions: int, seconds: float, frames_per_session: float) -> None:
        """One round: `sessions` blocks made in `seconds`, each of `frames_per_session` frames (on average)."""
        if sessions >= 1 and seconds > 0 and frames_per_session > 0:
            self.rounds.append((sessions, seconds, frames_per_session))

    def round_seconds(self, sessions: int) -> float | None:
        """The predicted seconds of a round of `sessions` sessions; None before any round."""
        if not self.rounds:
            return None
        ns = [n for n, _, _ in self.rounds]
        ts = [t for _, t, _ in self.rounds]
        if len(set(ns)) == 1:  # one size seen: through the origin (sequential cost, an upper bound)
            return sessions * sum(ts) / sum(ns)
        mean_n, mean_t = sum(ns) / len(ns), sum(ts) / len(ts)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(ns, ts)) / sum((n - mean_n) ** 2 for n in ns)
        slope = max(slope, 0.0)
        fixed = max(mean_t - slope * mean_n, 0.0)
        return fixed + slope * sessions

    def session_fps(self, sessions: int) -> float | None:
        """The frames per second each of `sessions` sessions would get; None before any round."""
        seconds = self.round_seconds(sessions)
        if seconds is None or seconds <= 0:
            return None
        frames = sum(f for _, _, f in self.rounds) / len(self.rounds)
        return frames / seconds

    def admits(self, sessions: int, min_fps: float) -> bool:
        """Whether `sessions` sessions (the admitted ones and one more) keep `min_fps` each: always with
        `min_fps` 0 (no capacity rule), for the first session, and before any round was measured."""
        if min_fps <= 0 or sessions <= 1:
            return True
        fps = self.session_fps(sessions)
        return fps is None or fps >= min_fps
