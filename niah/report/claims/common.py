"""Shared machinery of the claims ledger: :class:`Evidence` (what a run measured), :class:`Claim` (one ledger
row), and the helpers that more than one article's evaluators use (accuracy drops and their verdicts, the cache
layout of a dense model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from ...kv.layout import FULL, CacheLayout
from ..stats import ALPHA, interval_verdict, paired_table, wilson_interval


def dense_layout(arch: dict, kv_heads: int | None = None) -> CacheLayout:
    """The cache layout of a model whose every layer is full attention (the Llama configs of the article modules)."""
    return CacheLayout((FULL,) * arch["layers"], kv_heads or arch["kv_heads"], arch["head_dim"])


@dataclass
class Evidence:
    """What a run measured. Missing tables are empty frames; claims that need them say so."""

    config: str
    device: str = "cpu"
    commit: str = ""
    niah: pd.DataFrame = field(default_factory=pd.DataFrame)
    sweep: pd.DataFrame = field(default_factory=pd.DataFrame)
    weightquant: pd.DataFrame = field(default_factory=pd.DataFrame)
    kv_ppl: pd.DataFrame = field(default_factory=pd.DataFrame)  # niah.experiments.kvppl rows
    cold_warm: dict | None = None
    kv_value_share: float | None = None  # share of real K and V values within [-6, 6]
    # niah.experiments.llamacpp rows (llama.cpp's own caches)
    llamacpp: pd.DataFrame = field(default_factory=pd.DataFrame)

    def niah_method(self, method: str) -> pd.DataFrame:
        df = self.niah
        return df[(df["method"] == method) & (df["status"] == "ok")] if len(df) else df

    def sweep_method(self, method: str) -> pd.DataFrame:
        df = self.sweep
        return df[(df["method"] == method) & (df["status"] == "ok")].sort_values("length") if len(df) else df


def _missing(what: str) -> tuple[str, str]:
    return "", f"untestable here (no {what} in this run)"


def _single(verdict: str, detail: str) -> str:
    """``verdict``, with ``detail`` (n and the interval) when the interval does not decide it."""
    return f"inconclusive ({detail})" if verdict == "inconclusive" else verdict


def _drops(ev: Evidence, *methods: str, ref: str = "fp16") -> dict[str, dict] | None:
    """Per method, :func:`niah.report.stats.paired_table`'s row against ``ref`` over every question both answered,
    with the accuracy ``drop`` (ref - method) and its 95% interval ``drop_low``, ``drop_high`` (None unless every
    method and ``ref`` have rows).

    The interval is Newcombe's square-and-add of the two Wilson intervals, corrected for the pairing (1998,
    method 10); a bootstrap of the paired differences would shrink to a point when few questions are asked and
    all of them agree."""
    table = paired_table(ev.niah, ref, by=()) if len(ev.niah) else pd.DataFrame()
    if not len(table) or not set(methods) <= set(table["method"]):
        return None
    out = {}
    for m in methods:
        r = table[table["method"] == m].iloc[0].to_dict()
        n, lost, gained, p_ref, p = r["n"], r["losses"], r["gains"], r["ref_accuracy"], r["accuracy"]
        right = round(p_ref * n)
        both, neither = right - lost, n - right - gained
        margins, cross = right * (n - right) * (both + gained) * (lost + neither), both * neither - lost * gained
        # his corrected correlation (0 when a margin is empty: nothing to correct for)
        phi = (max(cross - n / 2, 0) if cross >= 0 else cross) / math.sqrt(margins) if margins else 0.0
        (lo_ref, hi_ref), lo, hi = wilson_interval(right, n), r["ci_low"], r["ci_high"]
        root = lambda x, y: math.sqrt(max(x * x - 2 * phi * x * y + y * y, 0.0))  # noqa: E731
        out[m] = {
            **r,
            "drop": p_ref - p,
            "drop_low": p_ref - p - root(p_ref - lo_ref, hi - p),
            "drop_high": p_ref - p + root(hi_ref - p_ref, p - lo),
        }
    return out


def _drop_verdict(d: dict, threshold: float, claim_holds_above: bool) -> tuple[str, str]:
    """(verdict, detail) on "the accuracy drop is above (or below) ``threshold``" from its interval; a drop above
    the threshold also needs McNemar's exact test to show a drop at all (p < 0.05)."""
    verdict = interval_verdict(d["drop_low"], d["drop_high"], threshold, claim_holds_above)
    if d["drop_low"] > threshold and d["p"] >= ALPHA:  # the interval alone cannot call a drop McNemar does not see
        verdict = "inconclusive"
    return verdict, f"n={d['n']}, accuracy drop {d['drop']:.2f} [{d['drop_low']:.2f}, {d['drop_high']:.2f}]"


def _drop_text(method: str, d: dict) -> str:
    return (
        f"{method} accuracy {d['accuracy']:.2f} [{d['ci_low']:.2f}, {d['ci_high']:.2f}] "
        f"vs fp16 {d['ref_accuracy']:.2f} on the same "
        f"{d['n']} questions: drop {d['drop']:+.2f} [{d['drop_low']:+.2f}, {d['drop_high']:+.2f}] "
        f"({d['losses']} lost, {d['gains']} gained, "
        f"McNemar p = {d['p']:.2g}), answer log-prob {d['logprob_diff']:+.2f} "
        f"[{d['logprob_low']:+.2f}, {d['logprob_high']:+.2f}]"
    )


@dataclass
class Claim:
    id: str
    seed: str  # the article's file name
    section: str
    claim: str
    test: str
    threshold: str
    evaluate: Callable[[Evidence], tuple[str, str]]
