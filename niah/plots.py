"""Figures: the Kamradt-style needle heatmap (depth on y, length on x, red-yellow-green, fixed 0-1 scale)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from .analysis import summarize


def heatmap_frame(df: pd.DataFrame, method: str, value: str = "accuracy") -> pd.DataFrame:
    """Depth x length grid of ``value`` for one method (NaN where a cell did not run)."""
    s = summarize(df[df["method"] == method], ["depth", "length"])
    return s.pivot(index="depth", columns="length", values=value).sort_index()


def needle_heatmap(df: pd.DataFrame, method: str, ax=None, title: str | None = None, diff_from: str | None = None):
    """Accuracy heatmap for ``method``; with ``diff_from`` the difference from that method (blue-white-red, -1..1)."""
    grid = heatmap_frame(df, method)
    n = heatmap_frame(df, method, "n")
    if diff_from:
        grid = grid - heatmap_frame(df, diff_from)
    ax = ax or plt.subplots(figsize=(1.1 * grid.shape[1] + 2.5, 0.5 * grid.shape[0] + 1.8))[1]
    kwargs = dict(vmin=-1, vmax=1, cmap="RdBu", center=0) if diff_from else dict(vmin=0, vmax=1, cmap="RdYlGn")
    labels = grid.map(lambda v: "" if pd.isna(v) else f"{v:.2f}") + n.map(lambda k: "" if pd.isna(k) else f"\nn={int(k)}")
    sns.heatmap(grid, ax=ax, annot=labels, fmt="", linewidths=0.5, cbar_kws={"label": "accuracy" + (" difference" if diff_from else "")}, **kwargs)
    ax.set_yticklabels([f"{d:.0%}" for d in grid.index], rotation=0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or (f"{method} minus {diff_from}" if diff_from else f"needle retrieval: {method}"))
    return ax


def save(fig, folder: str | Path, name: str) -> list[Path]:
    """Write ``name.png`` and ``name.svg`` under ``folder``; return the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.{ext}" for ext in ("png", "svg")]
    for p in paths:
        fig.savefig(p, dpi=120, bbox_inches="tight")
    return paths
