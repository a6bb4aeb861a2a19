"""Needle retrieval under weight schemes x KV-cache methods: notebook 03's battery, asked with each scheme's weights.

The questions, prompts and scoring are the battery's (:mod:`niah.experiments.battery`), at the lengths
``weightquant.needle_lengths``: with the battery's own settings when every one of those lengths is a battery
length (then the fp32 rows answer the same questions as notebook 03's), else a battery of those lengths alone
(``weightquant.needle`` may set its ``contexts`` and ``needles``).  One prefill per (scheme, question) serves
every KV method, so a scheme costs its prefills; rows (``weightquant_niah.jsonl``) are battery rows plus
``weights`` and ``simulated``, and their ``kl_vs_ref`` is against the same weights' fp16 cache.
:func:`weights_kv_table` pairs each cell with fp32 weights and the fp16 cache on the same questions, and
:func:`interaction_table` asks whether a KV method costs more on quantized weights than on fp32 ones.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..experiments.battery import battery_settings, run_battery
from ..kv.registry import get_method
from ..report.stats import PAIR_KEY, paired_bootstrap, paired_table
from ..schema import ConfigError
from .schemes import FP32, QuantizedModel
from .settings import settings

REF_METHOD = "fp16"
SEP = " | "  # joins a weight scheme and a KV method into one paired-table "method"


def usable_methods(names: list[str]) -> tuple[list[str], list[str]]:
    """(KV methods the registry knows, those it does not yet), keeping ``fp16`` first."""
    ok, missing = [], []
    for m in dict.fromkeys([REF_METHOD, *names]):
        try:
            get_method(m)
            ok.append(m)
        except ValueError:
            missing.append(m)
    return ok, missing


def needle_battery(cfg: dict) -> dict:
    """The battery settings whose questions the weights x KV cells ask (see the module docstring)."""
    s, w = battery_settings(cfg), settings(cfg)
    lengths = sorted(w["needle_lengths"])
    if not cfg.get("battery") or not set(lengths) <= set(s["lengths"]):
        s["lengths"] = lengths
    for k in ("contexts", "needles"):
        v = w["needle"][k]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"weightquant.needle.{k} must be a whole number of at least 1 (or null: the battery's); got {v!r}")
        s[k] = v if v is not None else s[k]
    return s


def run_needles(cfg: dict, lm, qm: QuantizedModel, methods: list[str], path) -> pd.DataFrame:
    """Ask the weights x KV questions of ``qm`` (applied to ``lm.model`` meanwhile) through ``methods``; its rows."""
    from ..rundir import open_table

    with qm.applied(lm.model):
        run_battery(
            cfg,
            lm,
            path,
            settings=needle_battery(cfg),
            lengths=settings(cfg)["needle_lengths"],
            methods=methods,
            table="weightquant_needles",
            tag={"weights": qm.name, "simulated": qm.scheme.simulated},
            label=f"needles {qm.name}",
        )
    df = pd.DataFrame(open_table(cfg, "weightquant_needles", path).rows())
    return df[df["weights"] == qm.name].reset_index(drop=True) if len(df) else df


def _cells(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``method`` renamed to ``weights | method`` (one paired-table "method" per cell)."""
    return df.assign(kv=df["method"], method=df["weights"] + SEP + df["method"])


def weights_kv_table(df: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Per (weights, KV method, length): n, accuracy [Wilson], and against fp32 weights with the fp16 cache on the
    same questions McNemar's exact p (losses/gains) and the answer log-prob difference [paired bootstrap]."""
    t = paired_table(_cells(df), FP32 + SEP + REF_METHOD, ("length",), seed)
    if not len(t):
        return t
    t[["weights", "kv"]] = t["method"].str.split(SEP, n=1, expand=True, regex=False)
    t["simulated"] = t["weights"].map(df.drop_duplicates("weights").set_index("weights")["simulated"])
    first = ["weights", "simulated", "kv"]
    return t.drop(columns="method")[[*first, *(c for c in t.columns if c not in ("method", *first))]]


def interaction_table(df: pd.DataFrame, seed: int = 0) -> pd.DataFrame:
    """Does a quantized KV cache cost more on quantized weights than on fp32?  Per (scheme, KV method, length), on the
    questions all four cells answered: the difference-in-differences of the answer log-prob,
    ``(scheme/kv - scheme/fp16) - (fp32/kv - fp32/fp16)``, and of accuracy, each with a paired bootstrap interval
    over questions; ``verdict``: ``costs more`` / ``costs less`` when the log-prob interval lies below / above 0,
    else ``inconclusive``."""
    ok = df[df["status"] == "ok"]
    keys = list(PAIR_KEY)
    cell = {k: g.set_index(keys) for k, g in ok.groupby(["weights", "method"])}
    rows = []
    for (w, m), mine in cell.items():
        if w == FP32 or m == REF_METHOD or (w, REF_METHOD) not in cell or (FP32, m) not in cell or (FP32, REF_METHOD) not in cell:
            continue
        parts = [mine, cell[(w, REF_METHOD)], cell[(FP32, m)], cell[(FP32, REF_METHOD)]]
        both = parts[0].index
        for p in parts[1:]:
            both = both.intersection(p.index)
        for L in sorted(set(both.get_level_values("length"))):
            idx = [i for i in both if i[keys.index("length")] == L]
            lp = [p.loc[idx, "answer_logprob"].to_numpy() for p in parts]
            acc = [(p.loc[idx, "score"].to_numpy() >= 1.0).astype(float) for p in parts]
            d, lo, hi = paired_bootstrap((lp[0] - lp[1]) - (lp[2] - lp[3]), seed)
            a, alo, ahi = paired_bootstrap((acc[0] - acc[1]) - (acc[2] - acc[3]), seed)
            rows.append(
                {
                    "weights": w,
                    "kv": m,
                    "length": L,
                    "n": len(idx),
                    "kv_cost_on_fp32": float(np.mean(lp[2] - lp[3])),
                    "kv_cost_on_weights": float(np.mean(lp[0] - lp[1])),
                    "logprob_did": d,
                    "low": lo,
                    "high": hi,
                    "accuracy_did": a,
                    "accuracy_low": alo,
                    "accuracy_high": ahi,
                    "verdict": "costs more" if hi < 0 else "costs less" if lo > 0 else "inconclusive",
                }
            )
    return pd.DataFrame(rows)
