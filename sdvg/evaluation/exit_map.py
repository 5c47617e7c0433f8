"""Early-exit maps: the denoising steps k* each token of each emitted block took, as a PNG heat map
(one row per block, one panel per latent frame; the colour scale runs over 1..K)."""
from __future__ import annotations

from pathlib import Path


def plot_exit_map(blocks: list[dict], num_steps: int, path: str | Path, title: str = "") -> Path:
    """blocks: [{"index", "decision", "steps": int tensor/array [F, gh, gw]}, ...] (blocks without a map are
    left out) -> PNG at `path`."""
    rows = [b for b in blocks if b.get("steps") is not None]
    if not rows:
        raise ValueError("nothing to draw: no emitted block was denoised with early exit (is --early-exit set for "
                         "the role that produced the blocks?)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    frames = max(int(np.asarray(b["steps"]).shape[0]) for b in rows)
    fig, axes = plt.subplots(len(rows), frames, figsize=(2.2 * frames + 1.2, 1.6 * len(rows) + 0.8), squeeze=False)
    image = None
    for r, b in enumerate(rows):
        steps = np.asarray(b["steps"])
        for f in range(frames):
            ax = axes[r][f]
            ax.set_xticks([])
            ax.set_yticks([])
            if f < steps.shape[0]:
                image = ax.imshow(steps[f], vmin=1, vmax=num_steps, cmap="viridis", interpolation="nearest")
            if f == 0:
                ax.set_ylabel(f"block {b['index']}\n{b['decision']}\nk={steps.mean():.2f}", fontsize=8)
            if r == 0:
                ax.set_title(f"latent frame {f}", fontsize=8)
    fig.colorbar(image, ax=axes, ticks=list(range(1, num_steps + 1)), label="steps k*", shrink=0.8)
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from sdvg.io.safe_files import save_figure

    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path
