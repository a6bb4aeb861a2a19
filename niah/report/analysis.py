"""Results tables -> summaries: accuracy with Wilson intervals, log-probs, KL, bytes."""

from __future__ import annotations

import pandas as pd

from ..config import Config
from .fits import dominant_period, polyfit
from .stats import paired_table, wilson_interval


def summarize(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: trials ``n``, ``accuracy`` (mean score) with its 95% Wilson interval, and means of the continuous
    scores.

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


def sweep_fits(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per method: linear fit of KV bytes on length (bytes per token, R^2), quadratic TTFT fit, TPOT growth."""
    rows = []
    for method, part in sweep[sweep["status"] == "ok"].groupby("method", sort=False):
        part = part.sort_values("length")
        kv = polyfit(part["length"], part["kv_bytes"], 1)
        ttft = polyfit(part["length"], part["ttft_s"], 2) if len(part) > 2 else None
        rows.append(
            {
                "method": method,
                "kv_bytes_per_token": kv.coef[0],
                "kv_r2": kv.r2,
                "ttft_quadratic_coef": ttft.coef[0] if ttft else float("nan"),
                "ttft_r2": ttft.r2 if ttft else float("nan"),
                "tpot_first_ms": 1e3 * part["tpot_median_s"].iloc[0],
                "tpot_last_ms": 1e3 * part["tpot_median_s"].iloc[-1],
                "longest": int(part["length"].iloc[-1]),
            }
        )
    return pd.DataFrame(rows)


def at_lengths(sweep: pd.DataFrame, lengths=None, ref: str = "fp16") -> pd.DataFrame:
    """Bytes per token, ratio to the reference, and TPOT ratio to the reference (paired round by round in the
    sweep, :func:`niah.experiments.sweep._paired_tpot`) at ``lengths`` (None: the sweep's three longest, as the cpu
    config's 4K, 8K and 16K; quick's 1K and 2K)."""
    if lengths is None:
        lengths = sorted({L for L in sweep["length"] if L > 1})[-3:]  # a 1-token step has no context to compare
    ok = sweep[(sweep["status"] == "ok") & sweep["length"].isin(lengths)].copy()
    ok["bytes_per_token"] = ok["kv_bytes"] / ok["length"]
    base = ok[ok["method"] == ref].set_index("length")
    ok["bytes_vs_ref"] = ok["kv_bytes"] / ok["length"].map(base["kv_bytes"])
    cols = [
        "method",
        "length",
        "bytes_per_token",
        "bits_per_value",
        "bytes_vs_ref",
        "tpot_median_s",
        "tpot_vs_ref",
        "tpot_vs_ref_low",
        "tpot_vs_ref_high",
        "score",
        "kl_vs_ref",
    ]
    return ok[[c for c in cols if c in ok]].sort_values(["length", "bytes_per_token"])


def breathing(sweep: pd.DataFrame) -> pd.DataFrame:
    """Dominant period and peak-to-trough amplitude of each memory trace (claim S0-10)."""
    rows = []
    for _, r in sweep[sweep["status"] == "ok"].iterrows():
        if len(r["trace_t"]) < 8:  # too few samples for dominant_period (it raises): leave the trace out
            continue
        osc = dominant_period(r["trace_t"], r["trace_bytes"])
        rows.append(
            {
                "method": r["method"],
                "length": r["length"],
                "samples": len(r["trace_t"]),
                "period_s": osc.period_s,
                "amplitude_MiB": osc.amplitude / 2**20,
                "autocorrelation": osc.strength,
            }
        )
    return pd.DataFrame(rows)


def kv_value_share(lm, cfg: Config, tokens: int = 2048, bound: float = 6.0) -> float:
    """Share of the real model's K and V values within [-bound, bound] over a ``tokens``-token pydoc prefill
    (claim S0-8)."""
    # heavy: the prefill loads transformers, for claim S0-8 only
    from ..data.haystack import haystack_text, tokenize_haystack
    from ..experiments.protocol import context_states, prefill

    ids = tokenize_haystack(haystack_text(cfg.haystack), lm.tokenizer, tokens).ids[:tokens]
    states = [s for s in context_states(prefill(lm.model, ids, chunk=cfg.niah.prefill_chunk)) if s.keys is not None]
    inside = sum(int((t.abs() <= bound).sum()) for s in states for t in (s.keys, s.values))
    total = sum(t.numel() for s in states for t in (s.keys, s.values))
    return inside / total


def accuracy_table(df: pd.DataFrame, ref: str = "fp16") -> pd.DataFrame:
    """Method x length: ``accuracy [95% Wilson]`` strings with ``n``; failed cells show their status."""
    s = summarize(df, ["method", "length"])
    status = df.groupby(["method", "length"])["status"].agg(lambda x: ",".join(sorted(set(x) - {"ok"})))
    s["cell"] = [
        f"{a:.2f} [{lo:.2f}, {hi:.2f}] n={int(n)}" if n else status.get((m, L), "")
        for m, L, a, lo, hi, n in zip(s["method"], s["length"], s["accuracy"], s["ci_low"], s["ci_high"], s["n"])
    ]
    table = s.pivot(index="method", columns="length", values="cell")
    order = [ref] + sorted(set(table.index) - {ref}, key=lambda m: -s[s["method"] == m]["bits_per_value"].mean())
    return table.loc[[m for m in order if m in table.index]]


def method_table(df: pd.DataFrame, ref: str = "fp16") -> pd.DataFrame:
    """Per method over all cells: accuracy (Wilson), log-prob, KL, top-1, and the stored bytes per token next to the
    format's bits."""
    ok = df[df["status"] == "ok"].assign(bytes_per_token=lambda d: d["kv_bytes"] / d["context_tokens"])
    s = summarize(df, ["method"])
    extra = (
        ok.groupby("method")
        .agg(bytes_per_token=("bytes_per_token", "mean"), analytical_bits=("analytical_bits", "mean"))
        .reset_index()
    )
    s = s.merge(extra, on="method")
    s["bytes_vs_ref"] = s["bytes_per_token"] / float(s.loc[s["method"] == ref, "bytes_per_token"].iloc[0])
    cols = [
        "method",
        "n",
        "accuracy",
        "ci_low",
        "ci_high",
        "answer_logprob",
        "kl_vs_ref",
        "top1_vs_ref",
        "bits_per_value",
        "analytical_bits",
        "bytes_per_token",
        "bytes_vs_ref",
    ]
    return s[cols].sort_values("bits_per_value", ascending=False).reset_index(drop=True)


def read_mode_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per method asked both ways (``name`` and ``name@engine``) and length: the ``@engine`` read paired against the
    ``strict`` one on the same questions (:func:`niah.report.stats.paired_table`): both accuracies, engine's losses
    and gains against strict, McNemar's p, the answer log-prob difference (engine - strict) with its interval, and
    the mean KL of each against the reference cache. Empty when no method was asked both ways."""
    ok = df[df["status"] == "ok"] if len(df) else df
    names = set(ok["method"]) if len(ok) else set()
    rows = []
    for engine in sorted(m for m in names if m.endswith("@engine") and m.removesuffix("@engine") in names):
        strict = engine.removesuffix("@engine")
        pair = ok[ok["method"].isin([strict, engine])]
        kl = pair.groupby(["method", "length"])["kl_vs_ref"].mean()
        for _, r in paired_table(pair, strict).query("method == @engine").iterrows():
            rows.append(
                {
                    "method": strict,
                    "length": r["length"],
                    "n": r["n"],
                    "strict": r["ref_accuracy"],
                    "engine": r["accuracy"],
                    "losses/gains": f"{r['losses']}/{r['gains']}",
                    "McNemar p": r["p"],
                    "log-prob engine - strict": r["logprob_diff"],
                    "low": r["logprob_low"],
                    "high": r["logprob_high"],
                    "KL strict": kl[(strict, r["length"])],
                    "KL engine": kl[(engine, r["length"])],
                }
            )
    return pd.DataFrame(rows)
