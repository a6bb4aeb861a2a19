"""Evaluators of seed article 003 (``003_fab91ec41442e6e4.txt``: W8A8, W4A8, sparse AWQ, FlashAttention-3, KV
quantization): claims S3-1 to S3-12, and the helpers only they use."""

from __future__ import annotations

import re

import pandas as pd

from ..stats import PAIR_KEY, paired_bootstrap
from .common import Evidence, _missing, dense_layout

# meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
# hidden 4096
LLAMA3_8B = {"layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}


# ---- evaluators: each returns (measured, verdict) -------------------------------------------------


def s3_6(ev):
    return "", "untestable here (FlashAttention-3 needs a Hopper GPU)"


def s3_7(ev):
    gqa = dense_layout(LLAMA3_8B).kv_bytes(2048, 16)["total"]
    mha = dense_layout(LLAMA3_8B, kv_heads=LLAMA3_8B["heads"]).kv_bytes(2048, 16)["total"]
    measured = (
        f"Llama-3-8B fp16 KV at 2048 tokens: {gqa / 1e6:.0f} MB with its 8 KV heads, "
        f"{mha / 1e9:.2f} GB if all 32 heads had KV"
    )
    return measured, "refuted" if abs(gqa - 2.7e9) / 2.7e9 > 0.1 and abs(mha - 2.7e9) / 2.7e9 > 0.1 else "supported"


def s3_8(ev):
    claimed = 2.7e9 / 112e6
    ceiling = 16 / 1
    measured = f"claimed {claimed:.1f}x; even 1-bit codes without scales give at most {ceiling:.0f}x over fp16"
    if len(ev.niah):
        ok = ev.niah[ev.niah["status"] == "ok"]
        best = ok.groupby("method")["bits_per_value"].mean()
        measured += f"; best measured here: {best.idxmin()} at {16 / best.min():.1f}x"
    return measured, "refuted" if claimed > ceiling else "supported"


def s3_9(ev):
    e4, e5 = ev.niah_method("fp8_e4m3"), ev.niah_method("fp8_e5m2")
    if not len(e4) or not len(e5):
        return _missing("fp8_e4m3 and fp8_e5m2 rows")
    ok = ev.niah[ev.niah["status"] == "ok"]
    kl = ok.pivot_table(index=list(PAIR_KEY), columns="method", values="kl_vs_ref")[["fp8_e4m3", "fp8_e5m2"]].dropna()
    diff, lo, hi = paired_bootstrap(kl["fp8_e5m2"] - kl["fp8_e4m3"])
    measured = (
        f"KL vs fp16 on the same {len(kl)} questions: "
        f"e4m3 {kl['fp8_e4m3'].mean():.2e}, e5m2 {kl['fp8_e5m2'].mean():.2e}, "
        f"e5m2 - e4m3 {diff:+.2e} [{lo:+.2e}, {hi:+.2e}] (95% paired bootstrap); "
        "'5-bit exponent + 2-bit mantissa' is e5m2, "
        "vLLM's default fp8 KV dtype is e4m3"
    )
    if lo > 0:  # e4m3, vLLM's default, is the better one
        return measured, "partly"
    return (
        measured,
        "supported" if hi < 0 else f"inconclusive (n={len(kl)}, KL e5m2 - e4m3 {diff:+.2e} [{lo:+.2e}, {hi:+.2e}])",
    )


def _any_group(name: str) -> str:
    """A scheme name with its group size left out (``W4A8 AutoRound g128`` -> ``W4A8 AutoRound g*``): the config's
    ``weightquant.group`` is part of every grouped scheme's name."""
    return re.sub(r" g\d+\b", " g*", name)


def _wq(ev: Evidence, scheme: str) -> pd.Series | None:
    """The weight-quantization row of ``scheme`` (status ok; ``g64`` in the name matches any group), or None."""
    df = ev.weightquant
    if not len(df) or "scheme" not in df:
        return None
    rows = df[(df["scheme"].map(_any_group) == _any_group(scheme)) & (df["status"] == "ok")]
    return rows.iloc[-1] if len(rows) else None


def _wq_rows(ev: Evidence, *schemes: str) -> list[pd.Series] | None:
    rows = [_wq(ev, s) for s in schemes]
    return None if any(r is None for r in rows) else rows


def s3_1(ev):
    rows = _wq_rows(ev, "W8A8 sym per-token", "W8A8 asym per-token")
    if rows is None:
        return _missing("W8A8 rows")
    sym, asym = (float(r["ppl_delta"]) for r in rows)
    close = abs(sym - 1.2) <= 0.3 and abs(asym - 0.7) <= 0.3
    measured = (
        f"perplexity +{sym:.2f} (symmetric per-channel weights) and +{asym:.2f} (asymmetric), "
        "simulated int8 activations"
    )
    return measured, "supported" if close else ("partly" if asym < sym else "refuted")


def s3_2(ev):
    rows = _wq_rows(ev, "W4A8 AutoRound g64", "W4A8 AutoRound g64 +1% int8 channels")
    if rows is None:
        return _missing("W4A8 rows")
    plain, kept = (float(r["ppl_delta"]) for r in rows)
    group = int(rows[0]["group"]) if "group" in rows[0] else 64
    measured = (
        f"W4A8 (AutoRound int4 g{group}, simulated int8 activations): +{plain:.2f} perplexity; "
        f"with 1% int8 input channels +{kept:.2f}"
    )
    block = _wq(ev, "W4A8 AutoRound g32 (source blocks)")
    if block is not None:  # issue 44: the same at the source file's block size
        measured += f"; {block['scheme']}, no kept channels: +{block['ppl_delta']:.2f}"
    if kept <= 2.1 * 1.5 and plain >= 10:
        return measured, "supported"
    return measured, "partly" if kept < plain else "refuted"


def s3_3(ev):
    rows = _wq_rows(ev, "fp32", "W4A4 AutoRound g64")
    if rows is None:
        return _missing("W4A4 and fp32 generations")
    ref, w4a4 = rows
    late = lambda r: max(v for k, v in r["repeat_by_segment"].items() if not k.startswith("0-"))  # noqa: E731
    garbage = float(w4a4["ppl_delta"]) > 100
    more_repeats = late(w4a4) > late(ref)
    measured = (
        f"W4A4 perplexity +{float(w4a4['ppl_delta']):.0f}; repeated 4-gram share after 128 tokens {late(w4a4):.2f} "
        f"(fp32 itself: {late(ref):.2f})"
    )
    return measured, "supported" if garbage and more_repeats else ("partly" if garbage or more_repeats else "refuted")


def s3_4(ev):
    df = ev.weightquant
    if not len(df) or "zero_share" not in df:
        return _missing("channel-mask rows")
    masks = df[(df["status"] == "ok") & (df["zero_share"].fillna(0).round(2) == 0.3)]
    by = {z: masks[masks["zero_by"] == z] for z in ("activation", "magnitude")}
    if any(not len(v) for v in by.values()):
        return _missing("30% activation-mask and magnitude-pruning rows")
    act, mag = (float(by[z]["ppl_delta"].iloc[-1]) for z in ("activation", "magnitude"))
    measured = (
        f"30% of input channels zeroed by activation salience: +{act:.2f} perplexity; "
        f"30% magnitude pruning: +{mag:.2f}; no fine-tuning"
    )
    if abs(act - 1.4) <= 0.7 and mag > act:
        return measured, "supported"
    return measured, "partly" if act < mag else "refuted"


def s3_5(ev):
    verdicts, parts = [], []
    for b in (3, 4):
        rows = _wq_rows(
            ev,
            *(
                f"W{b}A16 RTN g64 asym" + s
                for s in ("", " +1% fp16 by activation", " +1% fp16 by weight", " +1% fp16 by random")
            ),
        )
        if rows is None:
            continue
        plain, act, wt, rnd = (float(r["ppl_delta"]) for r in rows)
        parts.append(
            f"W{b}: +{plain:.2f} -> +{act:.2f} protecting 1% by activation (by weight +{wt:.2f}, random +{rnd:.2f})"
        )
        verdicts.append(act < 0.6 * plain and act < min(wt, rnd))
    if not verdicts:
        return _missing("salient-channel rows")
    return "; ".join(parts), "supported" if all(verdicts) else ("partly" if any(verdicts) else "refuted")


def s3_10(ev):
    check = _wq(ev, "auto-round W4A8 check")
    if check is None:
        return _missing("auto-round capability check")
    measured = (
        f"auto-round {check['auto_round_version']}: W4A8 presets {list(check['presets_w4a8']) or 'none'}; "
        "a custom act_bits=8 scheme "
        f"{'is accepted' if check['custom_w4a8_accepted'] else 'is refused'}; "
        f"real W4A8 export: {bool(check['real_w4a8_export'])}"
    )
    if check["custom_w4a8_accepted"] and check["real_w4a8_export"]:
        return measured, "supported"
    return measured, "partly" if check["custom_w4a8_accepted"] else "refuted"


def s3_11(ev):
    df = ev.weightquant
    if not len(df) or "kurtosis_fp32" not in df:
        return _missing("kurtosis rows")
    w4a8 = df[(df["scheme"].map(_any_group) == "W4A8 AutoRound g*") & (df["status"] == "ok")].drop_duplicates(
        "model", keep="last"
    )
    if not len(w4a8):
        return _missing("W4A8 rows")
    measured = "; ".join(
        f"{r['model']}: weight kurtosis {r['kurtosis_fp32']:.2f} (max layer {r['kurtosis_max_layer']:.1f}), "
        f"W4A8 +{r['ppl_delta']:.2f} perplexity"
        for _, r in w4a8.iterrows()
    )
    if len(w4a8) < 3:
        return measured, f"untestable here ({len(w4a8)} model(s); a predictor needs at least 3)"
    high = w4a8[w4a8["kurtosis_fp32"] > 4.5]["ppl_delta"]
    low = w4a8[w4a8["kurtosis_fp32"] <= 4.5]["ppl_delta"]
    if not len(high) or not len(low):
        return measured, "untestable here (all models on one side of 4.5)"
    return measured, "supported" if high.min() > low.max() else ("partly" if high.mean() > low.mean() else "refuted")


def s3_12(ev):
    df = ev.weightquant
    if not len(df) or "ppl_delta" not in df:
        return _missing("perplexity table")
    q = df[(df["status"] == "ok") & df["ppl_delta"].notna() & (df["scheme"] != "fp32")]
    if not len(q):
        return _missing("quantized perplexity rows")
    worst = q.loc[q["ppl_delta"].idxmax()]
    within = int((q["ppl_delta"] <= 1.5).sum())
    return (
        f"{within} of {len(q)} quantized configurations within +1.5 perplexity; "
        f"worst {worst['scheme']} +{worst['ppl_delta']:.1f}",
        "supported" if within == len(q) else "refuted",
    )


# The ledger's binding: claim ID of claims/claims.yaml -> its evaluator (read by niah.report.claims.load_claims).
EVALUATORS = {
    "S3-1": s3_1,
    "S3-2": s3_2,
    "S3-3": s3_3,
    "S3-4": s3_4,
    "S3-5": s3_5,
    "S3-6": s3_6,
    "S3-7": s3_7,
    "S3-8": s3_8,
    "S3-9": s3_9,
    "S3-10": s3_10,
    "S3-11": s3_11,
    "S3-12": s3_12,
}
