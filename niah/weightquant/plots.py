"""Figures of notebooks 01 and 02; every label of a scheme with simulated activations says ``[simulated]``."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns


def _labels(df: pd.DataFrame) -> list[str]:
    return [s + (" [simulated]" if sim else "") for s, sim in zip(df["scheme"], df["simulated"])]


def quality_bars(rows: pd.DataFrame, title: str):
    """Perplexity increase over fp32 and KL vs fp32 per scheme (two panels)."""
    df = rows[rows["scheme"] != "fp32"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * len(df) + 1.6), sharey=True)
    y = np.arange(len(df))
    axes[0].barh(y, df["ppl_delta"], color=["tab:orange" if s else "tab:blue" for s in df["simulated"]])
    axes[0].axvline(0, color="0.3", lw=0.8)
    axes[0].set_xscale("symlog", linthresh=1.0)
    axes[0].set_xlabel(
        f"perplexity - fp32 perplexity ({rows['ppl_fp32'].iloc[0]:.2f}), symlog; orange: simulated activations"
    )
    axes[1].barh(y, df["kl_vs_fp32"], color="0.5")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("KL(fp32 || scheme), mean over held-out positions")
    axes[0].set_yticks(y, _labels(df), fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def salience_distribution(summary: pd.DataFrame):
    """Per input type: max/median activation salience and the top-1% channels' share of it, across layers."""
    share = [c for c in summary.columns if c.endswith("_share")][0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    sns.boxplot(summary, x="input_of", y="max_over_median", ax=axes[0], color="0.85")
    sns.stripplot(summary, x="input_of", y="max_over_median", ax=axes[0], size=3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("max / median of mean |x| per channel")
    sns.lineplot(summary, x="layer", y=share, hue="input_of", marker="o", ax=axes[1])
    axes[1].axhline(0.01, color="0.5", ls="--", lw=0.8)
    axes[1].set_ylabel(f"{share.removesuffix('_share')} channels' share of summed salience (flat: 0.01)")
    for ax in axes:
        ax.set_xlabel(ax.get_xlabel().replace("input_of", "input read by"))
    fig.tight_layout()
    return fig


def kurtosis_vs_error(layers: pd.DataFrame, title: str):
    """Weight kurtosis against the relative output error of 4-bit RTN, one point per decoder linear."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.scatterplot(layers, x="kurtosis", y="rel_output_error", hue="type", ax=ax, s=25)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(4.5, color="0.5", ls="--", lw=0.8)
    ax.set_xlabel("weight kurtosis (Pearson; 3 = normal; dashed: the seed's 4.5)")
    ax.set_ylabel("relative output error on calibration tokens")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def combined_heatmap(table: pd.DataFrame, weights: list[str], methods: list[str]):
    """Weight scheme x KV method at one length (``table``: :func:`niah.report.tables.weights_kv_table` rows of that
    length): needle accuracy (colour) with its Wilson interval and n, McNemar's p and the mean answer log-prob
    difference against fp32 weights with the fp16 cache on the same questions."""
    grid = table.pivot(index="weights", columns="kv", values="accuracy").reindex(index=weights, columns=methods)
    text = table.assign(
        t=[
            f"{a:.2f} [{lo:.2f},{hi:.2f}] n={int(n)}\np={p:.2g}  dlogp {d:+.2f}"
            for a, lo, hi, n, p, d in zip(
                table["accuracy"], table["ci_low"], table["ci_high"], table["n"], table["p"], table["logprob_diff"]
            )
        ]
    )
    labels = (
        text.pivot(index="weights", columns="kv", values="t").reindex(index=weights, columns=methods).fillna("not run")
    )
    fig, ax = plt.subplots(figsize=(2.4 * len(methods) + 2.5, 0.9 * len(weights) + 1.5))
    sns.heatmap(
        grid,
        annot=labels,
        fmt="",
        vmin=0,
        vmax=1,
        cmap="RdYlGn",
        linewidths=0.5,
        ax=ax,
        annot_kws={"fontsize": 7},
        cbar_kws={"label": "needle accuracy"},
    )
    sims = table.drop_duplicates("weights").set_index("weights")["simulated"]
    ax.set_yticklabels([w + (" [simulated]" if sims.get(w, False) else "") for w in grid.index], rotation=0)
    ax.set_xlabel("KV cache method")
    ax.set_ylabel("weights")
    length = int(table["length"].iloc[0])
    ax.set_title(
        f"needle retrieval at {length} tokens: accuracy [95% Wilson], McNemar p and answer log-prob change "
        "vs fp32 weights + fp16 cache",
        fontsize=9,
    )
    fig.tight_layout()
    return fig
