"""Results tables of the experiments: perplexity through the stored cache, llama.cpp side by side, weight schemes x
KV methods, the weight schemes' generations and salient channels, and the key ablation at the longest length.

Each function takes the rows an experiment wrote (:mod:`niah.experiments.kvppl`, :mod:`niah.experiments.llamacpp`,
:mod:`niah.weightquant.needle`, :mod:`niah.weightquant.study`) and returns a DataFrame; the paired statistics they
use are :mod:`niah.report.stats`'s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from ..weightquant.schemes import FP32, REF_METHOD
from .stats import BOOTSTRAP, PAIR_KEY, mcnemar_exact, paired_bootstrap, paired_table


def perplexity_table(df: pd.DataFrame, ref: str = "fp16", bootstrap: int = BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Per method: perplexity over all scored tokens; ``ppl_vs_ref``, its ratio to the reference's perplexity on
    the same windows, with a 95% percentile-bootstrap interval (``ci_low``, ``ci_high``: windows resampled, one
    draw for both methods); mean KL and top-1 agreement against the reference; stored bits per value."""
    ok = df[df["status"] == "ok"]
    nll = ok.pivot_table(index="window", columns="method", values="nll_sum", aggfunc="sum")
    count = ok.pivot_table(index="window", columns="method", values="scored_tokens", aggfunc="sum")
    draws = np.random.default_rng(seed).integers(0, len(nll), size=(bootstrap, len(nll)))
    rows = []
    for method, part in ok.groupby("method", sort=False):
        row = {
            "method": method,
            "windows": len(part),
            "scored_tokens": int(part["scored_tokens"].sum()),
            "ppl": math.exp(part["nll_sum"].sum() / part["scored_tokens"].sum()),
            "ppl_vs_ref": float("nan"),
            "ci_low": float("nan"),
            "ci_high": float("nan"),
        }
        paired = nll[[method, ref]].notna().all(axis=1).to_numpy() if ref in nll else np.zeros(len(nll), bool)
        if paired.all():  # every window scored by both: bootstrap over windows
            row["ppl_vs_ref"] = math.exp(_log_ppl_ratio(nll, count, method, ref, np.arange(len(nll))))
            ratios = _log_ppl_ratio(nll, count, method, ref, draws)
            row["ci_low"], row["ci_high"] = np.exp(np.quantile(ratios, [0.025, 0.975]))
        row.update(
            {
                "kl_vs_ref": part["kl_vs_ref"].mean(),
                "top1_vs_ref": part["top1_vs_ref"].mean(),
                "bits_per_value": part["bits_per_value"].mean(),
            }
        )
        rows.append(row)
    return pd.DataFrame(rows).sort_values("bits_per_value", ascending=False).reset_index(drop=True)


def _log_ppl_ratio(nll: pd.DataFrame, count: pd.DataFrame, method: str, ref: str, windows: np.ndarray) -> np.ndarray:
    """``log(ppl_method / ppl_ref)`` over the windows at positions ``windows`` (``(..., n)``, repeats allowed)."""

    def log_ppl(m: str) -> np.ndarray:
        return nll[m].to_numpy()[windows].sum(-1) / count[m].to_numpy()[windows].sum(-1)

    return log_ppl(method) - log_ppl(ref)


def emulated_by(method: str) -> str:
    """This repo's emulation of a llama.cpp method: ``lcpp_q8_0_norot`` -> ``q8_0``, ``lcpp_f16`` -> ``fp16``."""
    kv = method.removeprefix("lcpp_").removesuffix("_norot")
    return "fp16" if kv == "f16" else kv


def agreement_table(lcpp, ours):
    """llama.cpp against this repo on the same questions, per llama.cpp method and length.

    ``lcpp``: llama.cpp rows; ``ours``: this repo's needle rows.  Columns: ``n`` paired questions, both engines'
    accuracy, the share of questions whose scores agree and whose greedy answers are the same text, the mean answer
    log-prob difference (llama.cpp - this repo) with its paired bootstrap interval, McNemar's p of each engine against
    its own f16, and each engine's mean KL against its own f16."""
    ok_l, ok_o = lcpp[lcpp["status"] == "ok"], ours[ours["status"] == "ok"]
    keys = list(PAIR_KEY)
    l_ref, o_ref = ok_l[ok_l["method"] == "lcpp_f16"].set_index(keys), ok_o[ok_o["method"] == "fp16"].set_index(keys)
    rows = []
    for (method, length), g in ok_l.groupby(["method", "length"], sort=False):
        mine = ok_o[ok_o["method"] == emulated_by(method)].set_index(keys)
        g = g.set_index(keys)
        both = g.index.intersection(mine.index).intersection(l_ref.index).intersection(o_ref.index)
        if not len(both):
            continue
        a, b = g.loc[both], mine.loc[both]
        d, lo, hi = paired_bootstrap(a["answer_logprob"].to_numpy() - b["answer_logprob"].to_numpy())
        rows.append(
            {
                "llama.cpp": method,
                "this repo": emulated_by(method),
                "length": length,
                "n": len(both),
                "accuracy llama.cpp": (a["score"] >= 1).mean(),
                "accuracy this repo": (b["score"] >= 1).mean(),
                "scores agree": ((a["score"] >= 1) == (b["score"] >= 1)).mean(),
                "same answer text": (a["generated"].str.strip() == b["generated"].str.strip()).mean(),
                "logprob diff": d,
                "logprob low": lo,
                "logprob high": hi,
                "McNemar p llama.cpp vs its f16": mcnemar_exact(l_ref.loc[both, "score"] >= 1, a["score"] >= 1)["p"],
                "McNemar p this repo vs its fp16": mcnemar_exact(o_ref.loc[both, "score"] >= 1, b["score"] >= 1)["p"],
                "KL llama.cpp": a["kl_vs_ref"].mean(),
                "KL this repo": b["kl_vs_ref"].mean(),
            }
        )
    return pd.DataFrame(rows)


def speed_table(lcpp):
    """llama.cpp's prefill tokens/s, decode s/token and session state MiB per method and length (medians over its
    questions), and the speed ratios to f16 measured in the same run."""
    ok = lcpp[lcpp["status"] == "ok"]
    t = ok.groupby(["method", "length"]).agg(
        n=("score", "size"),
        prefill_tok_s=("prefill_tokens_per_s", "median"),
        decode_s=("decode_s_per_token", "median"),
        state_mib=("state_bytes", lambda b: b.median() / 2**20),
    )
    f16 = t.xs("lcpp_f16", level="method")
    t["prefill_vs_f16"] = t["prefill_tok_s"] / t.index.get_level_values("length").map(f16["prefill_tok_s"]).to_numpy()
    t["decode_vs_f16"] = t["decode_s"] / t.index.get_level_values("length").map(f16["decode_s"]).to_numpy()
    return t.reset_index()


SEP = " | "  # joins a weight scheme and a KV method into one paired-table "method"


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
        if w == FP32 or m == REF_METHOD or any(c not in cell for c in ((w, REF_METHOD), (FP32, m), (FP32, REF_METHOD))):
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


def repetition_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Greedy generations: share of repeated 4-grams overall and per segment of the continuation, and its start."""
    g = rows[rows.get("repeat_share", pd.Series(index=rows.index, dtype=float)).notna()].reset_index(drop=True)
    segments = pd.DataFrame(list(g["repeat_by_segment"])).add_prefix("repeated, n-grams starting at ")
    head = pd.DataFrame(
        {
            "scheme": [s + (" [simulated]" if sim else "") for s, sim in zip(g["scheme"], g["simulated"])],
            "tokens": g["generated_tokens"].astype(int),
            "repeated 4-grams": g["repeat_share"].round(3),
        }
    )
    text = g["generated_text"].str.slice(0, 160).rename("text (first 160 characters)")
    return pd.concat([head, segments.round(3), text], axis=1)


def salient_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Perplexity of the AWQ paper's experiment: round-to-nearest, +kept channels by each choice, and AWQ scales; one
    column per bit width."""
    df = rows[(rows["w_bits"] < 16) & (rows["zero_share"] == 0) & (rows["a_bits"] == 16)].copy()
    df["variant"] = [
        "AWQ scales" if r == "awq" else (f"+{k:.0%} fp16 by {by}" if k else "round-to-nearest")
        for r, k, by in zip(df["rounding"], df["keep_share"], df["keep_by"])
    ]
    out = df.pivot_table(index="variant", columns="w_bits", values="ppl")
    out = out.rename(columns=lambda b: f"W{int(b)} perplexity")
    return out.assign(fp32=rows["ppl_fp32"].iloc[0]).round(3)


def coded_bits(method: str, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Bits per value of one attention layer that ``method`` codes, holding ``tokens`` tokens, measured from the stored
    tensors: a random block of that shape stored in a :class:`~niah.kv.cache.PackedLayer` (codes, scales, key
    statistics, raw sink tokens; raw recent tokens counted at fp16, as an engine keeps them).  The formats' sizes
    depend on the shape only; ``+static`` stores the same tensors as the per-prompt form, so it is counted as that."""
    from ..kv.cache import PackedLayer  # heavy: transformers, for this table only
    from ..kv.registry import get_method  # heavy: every KV method's module, for this table only

    layer = PackedLayer(get_method(method.replace("+static", "")), 0, keep_dequantized=False)
    x = torch.randn(1, kv_heads, tokens, head_dim, generator=torch.Generator().manual_seed(0))
    layer.update(x, x)
    packed, residual = layer.nbytes()
    return 8 * (packed + residual * 2 // x.element_size()) / (2 * x.numel())


def ablation_table(df: pd.DataFrame, ref: str, length: int, kv_heads: int, head_dim: int) -> pd.DataFrame:
    """Every method asked at ``length`` against ``ref`` (:func:`~niah.report.stats.paired_table`), with the bits per
    value on the layers it codes (:func:`coded_bits`), cheapest first: issue 41's ablation and the presets together."""
    t = paired_table(df[df["length"] == length], ref)
    if not len(t):  # no method paired with the reference at that length (e.g. every row failed): nothing to rank
        return t
    t = t[t["method"] != ref].copy()
    t.insert(1, "coded_bits", [coded_bits(m.partition("@")[0], kv_heads, head_dim, length) for m in t["method"]])
    return t.drop(columns=["length", "min_detectable_drop"]).sort_values(["coded_bits", "method"], ignore_index=True)
