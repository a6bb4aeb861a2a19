"""Paired statistics for method-vs-reference comparisons on the same questions, Wilson intervals for accuracies,
and interval verdicts.

Every comparison here pairs the two methods question by question (the same context, needle and prompt), and
treats questions as independent draws; questions that share a context share its haystack, so the intervals are
if anything a little narrow.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.stats import binomtest

ALPHA = 0.05
BOOTSTRAP = 2000


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (``successes`` may be fractional, e.g. summed scores)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the interval holds p exactly; at p = 0 or 1 float rounding can put an end a hair inside it (0.99999... for 1)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def mcnemar_exact(ref_correct, other_correct) -> dict:
    """McNemar's exact test on paired outcomes (arrays of bools, one per question).

    ``losses``: questions the reference gets right and the other method wrong; ``gains``: the reverse.  ``p`` is
    the two-sided exact binomial p-value of the discordant pairs (1.0 when there are none)."""
    ref, other = np.asarray(ref_correct, bool), np.asarray(other_correct, bool)
    losses, gains = int((ref & ~other).sum()), int((~ref & other).sum())
    p = binomtest(losses, losses + gains, 0.5).pvalue if losses + gains else 1.0
    return {"losses": losses, "gains": gains, "p": float(p)}


def paired_bootstrap(
    diff, seed: int = 0, resamples: int = BOOTSTRAP, level: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-question differences ``diff`` and its percentile bootstrap interval."""
    d = np.asarray(diff, float)
    if not len(d):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(d.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def min_detectable_drop(n: int, alpha: float = ALPHA) -> float:
    """The smallest accuracy drop that McNemar's exact test can call significant with ``n`` paired questions:
    ``k / n`` for the fewest losses ``k`` with no gains whose two-sided p-value is below ``alpha``.  A floor: a
    real drop with gains mixed in, or at less than full power, needs more."""
    for k in range(1, n + 1):
        if binomtest(0, k, 0.5).pvalue < alpha:
            return k / n
    return float("nan")


def interval_verdict(low: float, high: float, threshold: float, claim_holds_above: bool) -> str:
    """``supported`` or ``refuted`` only when the interval ``[low, high]`` lies wholly on one side of
    ``threshold``; ``inconclusive`` when it straddles it.  ``claim_holds_above``: the claim says the quantity is
    above the threshold (else below)."""
    if low > threshold:
        return "supported" if claim_holds_above else "refuted"
    if high < threshold:
        return "refuted" if claim_holds_above else "supported"
    return "inconclusive"


PAIR_KEY = ("prompt_style", "length", "depth", "trial")  # one question: the same for every method


def paired_table(df, ref: str = "fp16", by: tuple[str, ...] = ("length",), seed: int = 0):
    """Per method (and ``by`` group) against ``ref`` on the questions both answered (``status == ok``):
    ``n``, ``accuracy`` with its 95% Wilson interval, McNemar's exact ``p`` (with ``losses`` and ``gains``), the
    mean answer log-prob difference (method - ref) with a paired bootstrap interval, and the smallest drop the
    design can detect at that ``n``.  ``df`` is a needle results table (battery or grid rows)."""
    ok = df[df["status"] == "ok"]
    keys = [*by, *(k for k in PAIR_KEY if k not in by)]
    refs = ok[ok["method"] == ref].set_index(keys)
    rows = []
    for method, part in ok.groupby("method", sort=False):
        for group, g in part.groupby(list(by)) if by else [((), part)]:
            g = g.set_index(keys)
            both = g.index.intersection(refs.index)
            if not len(both):
                continue
            mine, theirs = g.loc[both], refs.loc[both]
            # right means every expected value was found (string_match_all == 1), so partial credit is wrong here
            correct, ref_correct = mine["score"].to_numpy() >= 1.0, theirs["score"].to_numpy() >= 1.0
            lo, hi = wilson_interval(correct.sum(), len(correct))
            test = mcnemar_exact(ref_correct, correct)
            d, dlo, dhi = paired_bootstrap(
                mine["answer_logprob"].to_numpy() - theirs["answer_logprob"].to_numpy(), seed
            )
            group = group if isinstance(group, tuple) else (group,)
            rows.append(
                {
                    "method": method,
                    **dict(zip(by, group)),
                    "n": len(correct),
                    "accuracy": correct.mean(),
                    "ci_low": lo,
                    "ci_high": hi,
                    "ref_accuracy": ref_correct.mean(),
                    **test,
                    "logprob_diff": d,
                    "logprob_low": dlo,
                    "logprob_high": dhi,
                    "min_detectable_drop": min_detectable_drop(len(correct)),
                }
            )
    return pd.DataFrame(rows)
