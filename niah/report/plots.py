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
    labels = grid.map(lambda v: "" if pd.isna(v) else f"{v:.2f}") + n.map(
        lambda k: "" if pd.isna(k) else f"\nn={int(k)}"
    )
    sns.heatmap(
        grid,
        ax=ax,
        annot=labels,
        fmt="",
        linewidths=0.5,
        cbar_kws={"label": "accuracy" + (" difference" if diff_from else "")},
        **kwargs,
    )
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


MARKS = (4096, 8192, 16384)


def _mark_lengths(ax, lengths) -> None:
    for m in MARKS:
        if min(lengths) <= m <= max(lengths):
            ax.axvline(m, color="0.8", lw=0.8, zorder=0)


def sweep_curves(sweep: pd.DataFrame, fits: pd.DataFrame):
    """Three panels against context length: KV bytes (with linear fits), TTFT, and TPOT median with its p90."""
    ok = sweep[sweep["status"] == "ok"].sort_values("length")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for method, part in ok.groupby("method", sort=False):
        r2 = fits.loc[fits["method"] == method, "kv_r2"].iloc[0]
        line = axes[0].plot(part["length"], part["kv_bytes"] / 2**20, "o-", ms=3, label=f"{method} (R²={r2:.4f})")[0]
        axes[1].plot(part["length"], part["ttft_s"], "o-", ms=3, color=line.get_color(), label=method)
        axes[2].plot(part["length"], 1e3 * part["tpot_median_s"], "o-", ms=3, color=line.get_color(), label=method)
        axes[2].fill_between(
            part["length"], 1e3 * part["tpot_median_s"], 1e3 * part["tpot_p90_s"], color=line.get_color(), alpha=0.15
        )
    labels = ("stored KV cache (MiB)", "TTFT: prefill + quantize (s)", "TPOT median, band to p90 (ms)")
    for ax, label in zip(axes, labels):
        _mark_lengths(ax, ok["length"])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def memory_traces(sweep: pd.DataFrame, length: int):
    """Sampled memory during store + decode at one length, one line per method."""
    ok = sweep[(sweep["status"] == "ok") & (sweep["length"] == length)]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for _, r in ok.iterrows():
        ax.plot(r["trace_t"], [b / 2**20 for b in r["trace_bytes"]], lw=1, label=r["method"])
    ax.set_xlabel("seconds since the method started storing the context")
    ax.set_ylabel(f"{ok['memory_source'].iloc[0] if len(ok) else 'memory'} (MiB)")
    ax.set_title(f"memory trace at {length} tokens")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def quality_vs_bits(summary: pd.DataFrame):
    """Accuracy and KL against stored bits per value, one point per method (the Pareto view)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for _, r in summary.iterrows():
        for ax, col in zip(axes, ("accuracy", "kl_vs_ref")):
            ax.scatter(r["bits_per_value"], r[col], s=30)
            ax.annotate(
                r["method"], (r["bits_per_value"], r[col]), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    axes[0].errorbar(
        summary["bits_per_value"],
        summary["accuracy"],
        yerr=[summary["accuracy"] - summary["ci_low"], summary["ci_high"] - summary["accuracy"]],
        fmt="none",
        ecolor="0.6",
        lw=0.8,
    )
    axes[0].set_ylim(-0.05, 1.05)
    axes[0].set_ylabel("needle accuracy (95% Wilson)")
    axes[1].set_yscale("symlog", linthresh=1e-4)
    axes[1].set_ylabel("KL vs reference cache (answer positions)")
    for ax in axes:
        ax.set_xlabel("stored bits per value (measured)")
    fig.tight_layout()
    return fig


def loss_breakdown(table: pd.DataFrame, parts: dict[str, tuple[str, str]], value: str = "kl_vs_ref"):
    """Per KV method, ``value`` (from :func:`niah.report.tables.perplexity_table`) of the whole method and of
    its breakdown rows (``parts``: row method -> (method, part)), one bar each: where the loss comes from."""
    by_name = table.set_index("method")[value]
    names = list(dict.fromkeys(m for m, _ in parts.values()))
    labels = ["all", *dict.fromkeys(p for _, p in parts.values())]
    grid = pd.DataFrame(float("nan"), index=names, columns=labels)
    for m in names:
        grid.loc[m, "all"] = by_name.get(m, float("nan"))
    for row, (m, part) in parts.items():
        grid.loc[m, part] = by_name.get(row, float("nan"))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) * len(labels) / 3 + 2), 4.5))
    grid.plot.bar(ax=ax, width=0.8, color=sns.color_palette("colorblind", len(labels)))
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_ylabel(f"{value} (reference cache)")
    ax.set_xlabel("")
    ax.set_title("where the loss comes from: the method on its own layers, and each part quantized alone")
    ax.legend(title="quantized", fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    return fig


def ablation(table: pd.DataFrame, ref_accuracy: float, length: int):
    """Accuracy at ``length`` against bits per value on the coded layers, one point per method of
    :func:`niah.report.tables.ablation_table` with its 95% Wilson interval; vLLM's presets (plain names) filled,
    the rest open; the reference's accuracy as a line.  Points are numbered (methods at the same point share a
    label) and named in a key beside the axes, since many methods share one bit width."""
    fig, (ax, key) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    labels: dict[tuple[float, float], list[str]] = {}
    lines = []
    for i, r in table.reset_index(drop=True).iterrows():
        preset = "+" not in r["method"] and r["method"].startswith("turboquant_")
        yerr = [[max(r["accuracy"] - r["ci_low"], 0)], [max(r["ci_high"] - r["accuracy"], 0)]]  # rounding: never < 0
        colour = "C0" if preset else "C1"
        ax.errorbar(
            r["coded_bits"],
            r["accuracy"],
            yerr=yerr,
            fmt="o",
            ms=6,
            color=colour,
            mfc=colour if preset else "white",
            ecolor="0.7",
            lw=0.8,
        )
        labels.setdefault((round(r["coded_bits"], 1), r["accuracy"]), []).append(str(i + 1))
        lines.append(f"{i + 1:>2}  {r['method']}  ({r['coded_bits']:.2f} bits, {r['accuracy']:.2f}, p = {r['p']:.2g})")
    for (bits, acc), names in labels.items():
        ax.annotate(",".join(names), (bits, acc), fontsize=8, xytext=(5, 2), textcoords="offset points")
    ax.axhline(ref_accuracy, color="0.4", ls="--", lw=1, label=f"reference (fp16): {ref_accuracy:.2f}")
    ax.set_xlabel("bits per value on the layers the method codes (measured from the stored tensors)")
    ax.set_ylabel(f"needle accuracy at {length} tokens (95% Wilson)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Key tricks on vLLM's presets (filled: vLLM's presets as shipped)")
    key.axis("off")
    key.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=7, transform=key.transAxes)
    fig.tight_layout()
    return fig
