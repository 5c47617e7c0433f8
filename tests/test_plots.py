"""The sweep plots read well: signed tau labels that overlap no other label, the front drawn as a line, a
title and axis units; integer block ticks on acceptance-by-block."""
import math

import pytest

from sdvg.evaluation.plots import place_labels, signed, tau_label


def _summary(taus_speed_quality, acceptance=1.0):
    rows = [{"tau": t, "speedup": s, "quality": q, "acceptance": acceptance, "seconds": 1.0 / s,
             "acceptance_by_block": {"1": acceptance, "2": 0.5, "3": 0.25}} for t, s, q in taus_speed_quality]
    return {"prompts": 8, "quality_metric": "imagereward", "quality_higher_is_better": True, "taus": rows,
            "target": {"tau": "target", "speedup": 1.0, "quality": 0.35, "seconds": 2.0, "acceptance": None},
            "draft": {"tau": "draft", "speedup": 1.6, "quality": 0.30, "seconds": 1.25, "acceptance": None}}


def test_labels_are_signed_with_a_real_minus():
    assert signed(-0.7) == "\u22120.7" and signed(0.0) == "+0" and signed(1.5) == "+1.5"
    assert signed(-math.inf) == "\u2212\u221e" and signed(math.inf) == "+\u221e"
    assert tau_label({"tau": -2.5, "acceptance": 0.731}) == "\u03c4 \u22122.5 (73%)"
    two = tau_label({"tau": -2.5, "acceptance": 1.0}, {"tau": -0.7, "acceptance": 1.0})
    assert two == "\u03c4 \u22122.5, \u22120.7 (100%)"


def test_crowded_labels_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    points = [(1.0 + 0.004 * i, 0.3 - 0.0005 * (i % 3)) for i in range(7)]  # a tight cluster
    ax.scatter(*zip(*points))
    ax.margins(0.3)
    texts = [f"\u03c4 {signed(-0.25 * i)} (100%)" for i in range(7)]
    anns = place_labels(ax, points, texts)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [matplotlib.text.Text.get_window_extent(a, renderer) for a in anns]  # the text, not its leader
    frame = ax.get_window_extent(renderer)
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    assert sorted(a.get_text() for a in anns) == sorted(texts)
    plt.close(fig)


def test_pareto_plot_has_front_title_units_and_labels(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdvg.evaluation import plots

    captured = {}
    monkeypatch.setattr(plt, "close", lambda fig: captured.setdefault("fig", fig))
    summary = _summary([(-0.7, 1.3, 0.34), (-1.0, 1.31, 0.339), (-2.5, 1.5, 0.31), (0.0, 1.05, 0.349)])
    plots.pareto_plot(summary, tmp_path / "p.png")
    ax = captured["fig"].axes[0]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "speed-up" in ax.get_title() and "8 prompts" in ax.get_title()
    assert "\u00d7" in ax.get_xlabel() and "higher is better" in ax.get_ylabel()
    front = [line for line in ax.get_lines() if line.get_label().startswith("Pareto front")]
    assert len(front) == 1 and len(front[0].get_xdata()) >= 2  # drawn, through its points
    labels = [t.get_text() for t in ax.texts]
    assert "\u03c4 \u22120.7 (100%)" in labels and "\u03c4 +0 (100%)" in labels


def test_acceptance_by_block_has_integer_ticks(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdvg.evaluation.report import plot_acceptance_by_block

    captured = {}
    monkeypatch.setattr(plt, "close", lambda fig: captured.setdefault("fig", fig))
    plot_acceptance_by_block(_summary([(-0.7, 1.3, 0.34), (-2.5, 1.5, 0.31)]), tmp_path / "a.png")
    ax = captured["fig"].axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks == [1, 2, 3] and all(float(t).is_integer() for t in ticks)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["\u03c4 \u22120.7", "\u03c4 \u22122.5"]
    assert ax.get_title()


@pytest.mark.parametrize("value", [float("nan")])
def test_signed_nan_is_plain(value):
    assert signed(value) == "+nan"
