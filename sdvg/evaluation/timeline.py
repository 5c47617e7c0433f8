"""Stage-call timelines: a generation's `stats["trace"]` drawn on three lanes (drafter, VAE +
reward, target), every call where it really ran. Run-ahead shows the drafter's calls beside the
target's; a rejected block shows its draft, the target's regeneration and the flushed commits."""
from __future__ import annotations

from pathlib import Path

STAGE_COLORS = {"draft": "tab:blue", "drafter_commit": "tab:cyan", "decode": "tab:green", "score": "tab:olive",
                "target": "tab:red", "target_commit": "tab:orange", "recache": "tab:purple"}
# a re-cache (a live session's new conditioning) is either role's: drawn thin between the target's and the VAE's lanes
LANES = {"draft": 2, "drafter_commit": 2, "decode": 1, "score": 1, "target": 0, "target_commit": 0, "recache": 0.5}
LANE_NAMES = ["target", "VAE + reward", "drafter"]


def decisions_of(blocks: list[dict]) -> dict[int, str]:
    """{block index: decision} of a stats dict's `blocks` (or any list of {"index", "decision", ...})."""
    return {b["index"]: b["decision"] for b in blocks}


def plot_timeline(panels: list[dict], path: str | Path) -> Path:
    """panels: [{"title": str, "trace": [span, ...], "decisions": {block: decision}}, ...] -> PNG at `path`.

    A span is {"block", "stage", "thread" (main|drafter), "start_s", "end_s"}, as the schedulers record it."""
    if not panels or not any(p["trace"] for p in panels):
        raise ValueError("nothing to draw: these stats hold no stage trace; generate again to record one")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 1.3 + 1.3 * len(panels)  # inches
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height), squeeze=False, sharex=True)
    for ax, panel in zip(axes[:, 0], panels):
        first: dict[int, float] = {}
        for sp in panel["trace"]:
            ax.barh(LANES[sp["stage"]], sp["end_s"] - sp["start_s"], left=sp["start_s"],
                    height=0.3 if sp["stage"] == "recache" else 0.8,
                    color=STAGE_COLORS[sp["stage"]], edgecolor="black", lw=0.3,
                    alpha=0.6 if sp["thread"] == "drafter" else 1.0)
            first.setdefault(sp["block"], sp["start_s"])
        for b, t in first.items():
            d = panel.get("decisions", {}).get(b, "")
            ax.text(t, 2.45 + 0.25 * (b % 2), f"{b}{d[:1]}", fontsize=7)
        ax.set_yticks([0, 1, 2], LANE_NAMES, fontsize=8)
        ax.set_ylim(-0.6, 3.1)
        ax.set_title(panel["title"], fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of the video (block index + f/a/r/t/d = forced/accepted/"
                           "rejected/target/draft; lighter: drafter thread)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLORS.values()]
    fig.legend(handles, list(STAGE_COLORS), fontsize=7, ncol=7, loc="lower center")
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))  # room for the legend below
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from sdvg.io.safe_files import save_figure

    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path
