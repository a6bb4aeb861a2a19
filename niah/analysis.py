"""Results tables -> summaries: accuracy with Wilson intervals, log-probs, KL, bytes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .results import read_rows
from .scoring import wilson_interval


def load_results(path: str | Path) -> pd.DataFrame:
    """The results table as a DataFrame (empty frame if the file does not exist)."""
    return pd.DataFrame(read_rows(path))


def summarize(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: trials ``n``, ``accuracy`` (mean score) with its 95% Wilson interval, and means of the continuous scores.

    Only rows with status ``ok`` count; ``not_ok`` says how many cells failed (too long, out of memory, error).
    """
    ok = df[df["status"] == "ok"]
    groups = ok.groupby(by, dropna=False)
    out = groups.agg(
        n=("score", "size"),
        accuracy=("score", "mean"),
        answer_logprob=("answer_logprob", "mean"),
        kl_vs_ref=("kl_vs_ref", "mean"),
        top1_vs_ref=("top1_vs_ref", "mean"),
        bits_per_value=("bits_per_value", "mean"),
    ).reset_index()
    ci = [wilson_interval(a * n, n) for a, n in zip(out["accuracy"], out["n"])]
    out["ci_low"], out["ci_high"] = [c[0] for c in ci], [c[1] for c in ci]
    failed = df[df["status"] != "ok"].groupby(by, dropna=False).size().rename("not_ok").reset_index()
    return out.merge(failed, on=by, how="outer").fillna({"not_ok": 0, "n": 0})
