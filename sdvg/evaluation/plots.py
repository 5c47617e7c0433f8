"""The sweep's plots, drawn for a person to read: the quality / speed-up Pareto plot (every tau labelled with
its sign, no label over another, the front drawn as a line, a title and axis units) and the accepted share
per block index (integer block ticks).

Labels are placed without any layout library: each label tries offsets around its point, nearest first,
and takes the first whose rendered extent overlaps no label already placed, no marker and stays inside
the axes; a label placed away from its point gets a thin leader line."""
from __future__ import annotations

import math
from pathlib import Path

from sdvg.evaluation.pareto import all_rows, pareto

MINUS = "\u2212"  # a typographic minus: wider than "-", it survives small fonts
# candidate label offsets in points, nearest first: right, upper right, lower right, left, above, below, ...
DIRECTIONS = ((1, 0), (1, 1), (1, -1), (-1, 0), (-1, 1), (-1, -1), (0, 1), (0, -1))
RADII = (6, 14, 24, 36, 50, 66, 84, 104, 126)


def signed(value: float) -> str:
    """+0.5, −0.7, +0, −∞: always a sign, with a real minus."""
    if math.isinf(value):
        return ("+" if value > 0 else MINUS) + "\u221e"
    text = f"{value:+g}"
    return text.replace("-", MINUS)


def tau_label(*rows: dict) -> str:
    """`τ −0.7 (100%)`; rows drawn on one spot share a label: `τ −2.5, −0.7 (100%, 100%)`."""
    accs = ["n/a" if r.get("acceptance") is None else f"{r['acceptance']:.0%}" for r in rows]
    acc = accs[0] if len(set(accs)) == 1 else ", ".join(accs)
    return f"\u03c4 {', '.join(signed(float(r['tau'])) for r in rows)} ({acc})"


def coincident(ax, rows: list[dict], within_px: float = 5.0) -> list[list[dict]]:
    """The rows grouped by where they are drawn: rows within `within_px` pixels of a group's first share
    its label (highest tau first)."""
    ax.figure.canvas.draw()
    groups: list[tuple[tuple[float, float], list[dict]]] = []
    for r in sorted(rows, key=lambda r: -float(r["tau"])):
        px, py = ax.transData.transform((r["speedup"], r["quality"]))
        for (gx, gy), members in groups:
            if math.hypot(px - gx, py - gy) <= within_px:
                members.append(r)
                break
        else:
            groups.append(((px, py), [r]))
    return [members for _, members in groups]


def _overlaps(box, others, pad: float = 1.5) -> bool:
    return any(box.x0 < o.x1 + pad and box.x1 > o.x0 - pad and box.y0 < o.y1 + pad and box.y1 > o.y0 - pad
               for o in others)


def _crosses(start: tuple[float, float], box, others) -> bool:
    """Whether the leader from `start` to the nearest point of `box` passes through any of `others`."""
    ex, ey = min(max(start[0], box.x0), box.x1), min(max(start[1], box.y0), box.y1)
    for k in range(1, 20):
        x, y = start[0] + (ex - start[0]) * k / 20, start[1] + (ey - start[1]) * k / 20
        if any(o.x0 <= x <= o.x1 and o.y0 <= y <= o.y1 for o in others):
            return True
    return False


def _inside(box, frame) -> bool:
    return box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y0 >= frame.y0 and box.y1 <= frame.y1


def place_labels(ax, points: list[tuple[float, float]], texts: list[str], fontsize: float = 7.5,
                 obstacles: list[tuple[float, float]] = ()) -> list:
    """One annotation per point, none overlapping another, a marker (the points and `obstacles`) or the
    legend (see the module docstring); returns the annotations. Points are placed from the top down."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    markers = [] if ax.get_legend() is None else [ax.get_legend().get_window_extent(renderer)]
    legend = len(markers)  # markers[legend + i] is point i's own marker
    pixels = [tuple(ax.transData.transform(p)) for p in points]
    for px, py in pixels + [tuple(ax.transData.transform(p)) for p in obstacles]:
        markers.append(Bbox.from_bounds(px - 7, py - 7, 14, 14))
    placed, annotations = [], []
    order = sorted(range(len(points)), key=lambda i: (-points[i][1], points[i][0]))
    for i in order:
        xy, text = points[i], texts[i]
        chosen = None
        for radius in RADII:
            for dx, dy in DIRECTIONS:
                probe = _annotate(ax, text, xy, (dx * radius, dy * radius), fontsize, leader=False)
                box = probe.get_window_extent(renderer)  # the text alone
                probe.remove()
                others = placed + markers[:i + legend] + markers[i + legend + 1:]
                if _inside(box, frame) and not _overlaps(box, others + [markers[i + legend]]) \
                        and not _crosses(pixels[i], box, others):
                    chosen = ((dx * radius, dy * radius), box)
                    break
            if chosen is not None:
                break
        if chosen is None:  # crowded beyond every candidate: the farthest one
            offset = (RADII[-1], -RADII[-1] / 2)
            probe = _annotate(ax, text, xy, offset, fontsize, leader=False)
            chosen = (offset, probe.get_window_extent(renderer))
            probe.remove()
        offset, box = chosen
        placed.append(box)
        beside = offset[1] == 0 and abs(offset[0]) <= RADII[0]  # a label right beside its point needs no leader
        annotations.append(_annotate(ax, text, xy, offset, fontsize, leader=not beside))
    return annotations


def _annotate(ax, text: str, xy, offset: tuple[float, float], fontsize: float, leader: bool):
    """A label at `offset` points from `xy`, aligned away from it; `leader`: a thin line back to the point
    (every label not right beside its point has one)."""
    dx, dy = offset
    return ax.annotate(text, xy, xytext=offset, textcoords="offset points", fontsize=fontsize,
                       ha="left" if dx > 0 else "right" if dx < 0 else "center",
                       va="bottom" if dy > 0 else "top" if dy < 0 else "center",
                       arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0, shrinkB=3) if leader else None)


def pareto_plot(summary: dict, path: Path) -> None:
    """Quality against speed-up: SDVG at each tau (labelled with tau and the acceptance), target-only,
    draft-only, and the Pareto front of all of them drawn as a line through its points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["taus"]
    higher = summary.get("quality_higher_is_better", True)
    metric = summary.get("quality_metric") or "quality"
    fig, ax = plt.subplots(figsize=(7.5, 5))
    front = pareto(all_rows(summary), higher)
    ax.plot([r["speedup"] for r in front], [r["quality"] for r in front], "-", color="0.35", lw=1.2, zorder=1,
            label=f"Pareto front ({len(front)} point{'s' * (len(front) != 1)})")
    ax.scatter([r["speedup"] for r in rows], [r["quality"] for r in rows], zorder=3, label="SDVG at \u03c4")
    for key, marker, label in (("target", "*", "target-only"), ("draft", "s", "draft-only")):
        r = summary.get(key)
        if r is not None:
            ax.scatter([r["speedup"]], [r["quality"]], marker=marker, s=140 if marker == "*" else 60, zorder=3,
                       label=label)
    ax.scatter([r["speedup"] for r in front], [r["quality"] for r in front], s=110, facecolors="none",
               edgecolors="0.35", lw=1.0, zorder=2)
    ax.set_xlabel("speed-up over target-only (\u00d7, mean wall time per video)")
    ax.set_ylabel(f"{metric} (mean score per video; {'higher' if higher else 'lower'} is better)")
    target = summary.get("target")
    sub = f"{summary.get('prompts', '?')} prompts" + (
        f"; target-only {target['seconds']:.2f} s per video" if target and target.get("seconds") else "")
    ax.set_title(f"Quality vs speed-up of SDVG over \u03c4 (label: \u03c4, acceptance)\n{sub}", fontsize=10)
    ax.grid(True, lw=0.4, alpha=0.5)
    ax.margins(x=0.25, y=0.2)  # room for the labels inside the axes
    ax.legend(fontsize=8, loc="best")
    others = [(r["speedup"], r["quality"]) for r in (summary.get("target"), summary.get("draft")) if r is not None]
    groups = coincident(ax, rows)
    place_labels(ax, [(g[0]["speedup"], g[0]["quality"]) for g in groups], [tau_label(*g) for g in groups],
                 obstacles=others)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance_by_block_plot(table: dict, path: Path) -> None:
    """The accepted share of each block index (1..B-1) at each tau; `table` is `report.acceptance_table`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, ax = plt.subplots(figsize=(6.5, 4))
    styles = ("o-", "s--", "^-.", "D:", "v-", "P--", "X-.", "*:")  # equal shares stay visible one over another
    n = len(table["rows"])
    for i, (tau, shares) in enumerate(table["rows"]):
        ax.plot(table["blocks"], [float("nan") if s is None else s for s in shares], styles[i % len(styles)],
                lw=1.0 + 1.5 * (n - 1 - i) / max(n - 1, 1), ms=4 + 4 * (n - 1 - i) / max(n - 1, 1),
                label=f"\u03c4 {signed(float(tau))}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if table["blocks"] and len(table["blocks"]) <= 20:
        ax.set_xticks(table["blocks"])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("block index (block 0 always comes from the target)")
    ax.set_ylabel("accepted share of the prompts")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Drafts accepted per block index", fontsize=10)
    ax.grid(True, lw=0.4, alpha=0.5)
    if table["rows"]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
