"""Evaluators of seed article 000 (``000_cda357c30780f108.txt``: q8_0 KV cache, needle retrieval at 4K/8K/16K,
llama.cpp): claims S0-1 to S0-15, and the helpers only they use."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...kv.layout import FULL, LINEAR, CacheLayout, qwen3_5_35b_a3b_config
from ...kv.registry import get_method
from ..analysis import breathing, sweep_fits
from ..stats import BOOTSTRAP, interval_verdict, paired_bootstrap, paired_table, wilson_interval
from ..tables import speed_table
from .common import Evidence, _drop_text, _drop_verdict, _drops, _missing, _single


def _combine(parts: dict[str, tuple[str, str]]) -> str:
    """One verdict from a two-part claim's ``{part: (verdict, detail)}``: the parts' verdict when they agree,
    ``partly`` when one is supported and the other refuted, else ``inconclusive``; naming each part then."""
    words = {v for v, _ in parts.values()}
    if len(words) == 1 and words <= {"supported", "refuted"}:
        return words.pop()
    each = "; ".join(f"{name}: {_single(v, detail)}" for name, (v, detail) in parts.items())
    return f"{'partly' if words == {'supported', 'refuted'} else 'inconclusive'} ({each})"


def _llamacpp_note(ev: Evidence, what: str) -> str:
    """One clause of llama.cpp's own evidence for a claim (empty when the cross-check did not run): ``what`` is
    ``accuracy`` (q8_0 and q4_0 against llama.cpp's f16 on the same questions), ``kl``, ``decode`` or ``memory``."""
    df = ev.llamacpp
    if not len(df) or "lcpp_f16" not in set(df["method"]):
        return ""
    ok = df[df["status"] == "ok"]
    if what == "accuracy":
        t = paired_table(ok, "lcpp_f16", by=()).set_index("method")
        parts = [
            f"{m} {t.loc[m, 'accuracy']:.2f} vs f16 {t.loc[m, 'ref_accuracy']:.2f} (McNemar p = {t.loc[m, 'p']:.2g})"
            for m in t.index
            if m != "lcpp_f16"
        ]
        body = ", ".join(parts)
    elif what == "kl":
        q8 = ok[ok["method"] == "lcpp_q8_0"]["kl_vs_ref"]
        kl, lo, hi = paired_bootstrap(q8)
        body = f"mean KL(f16 || q8_0) = {kl:.2e} [{lo:.2e}, {hi:.2e}]"
    else:
        sp = speed_table(ok).set_index(["method", "length"])
        L = sp.index.get_level_values("length").max()
        if ("lcpp_q8_0", L) not in sp.index:
            return ""
        row, f16 = sp.loc[("lcpp_q8_0", L)], sp.loc[("lcpp_f16", L)]
        body = (
            f"q8_0 / f16 decode time per token = {row['decode_vs_f16']:.2f} at {L} tokens "
            f"(medians of {int(row['n'])} questions)"
            if what == "decode"
            else f"session state at {L} tokens: q8_0 {row['state_mib']:.1f} MiB, f16 {f16['state_mib']:.1f} MiB"
        )
    return f"; llama.cpp itself (same GGUF and token ids, {int((ok['method'] == 'lcpp_f16').sum())} questions): {body}"


# ---- evaluators: each returns (measured, verdict) -------------------------------------------------


def s0_1(ev):
    n = len(ev.niah[ev.niah["status"] == "ok"]) if len(ev.niah) else 0
    if not n:
        return _missing("needle grid")
    return f"{n} needle-in-a-haystack cells retrieved and scored", "refuted"


def s0_2(ev):
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    p = get_method("q8_0").key.quantize(x)
    per = x.numel() / p.tensors["scales"].numel()
    return (
        f"our q8_0 (bit-exact with gguf.quants, see tests) keeps one fp16 scale per {per:.0f} values"
        + _llamacpp_note(ev, "memory"),
        "refuted" if per < x.numel() else "supported",
    )


def s0_3(ev):
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    q4k_bits = 8 * size / block
    q8 = ev.niah_method("q8_0")
    if not len(q8):
        return _missing("q8_0 rows")
    q8_bits = float(q8["bits_per_value"].mean())
    change = q8_bits / q4k_bits - 1
    verdict = "supported" if -0.22 <= change <= -0.12 else "refuted"
    return (
        f"q8_0 stores {q8_bits:.2f} bits/value, q4_K {q4k_bits:.2f}: q8_0 uses {change:+.0%} memory"
        + _llamacpp_note(ev, "memory"),
        verdict,
    )


def s0_4(ev):
    page, row = 4096, 16384 * 128 * 2
    waste = (-row) % page
    measured = f"(16384, 128) fp16 = {row / 2**20:.2f} MiB = {row // page} whole 4 KiB pages, alignment waste {waste} B"
    ref = ev.sweep_method("fp16").set_index("length") if len(ev.sweep) else None
    if ref is not None and {4096, 16384} <= set(ref.index):
        measured += f"; measured KV bytes 16K/4K = {ref.loc[16384, 'kv_bytes'] / ref.loc[4096, 'kv_bytes']:.3f}"
    return measured, "refuted" if waste == 0 and 6.8e6 > row * 1.05 else "supported"


def s0_5(ev):
    if not len(ev.sweep):
        return _missing("pressure sweep")
    fits = sweep_fits(ev.sweep)
    worst = fits["kv_r2"].min()
    measured = f"linear fit of KV bytes on length: R^2 >= {worst:.6f} for all {len(fits)} methods, fp16 included"
    return measured, "refuted" if worst > 0.999 else "partly"


def s0_6(ev):
    layout = CacheLayout.from_config(qwen3_5_35b_a3b_config())
    kv = layout.kv_bytes(16384, 16)["total"]
    measured = (
        f"the whole fp16 KV cache of Qwen3.5-35B-A3B at 16K is {kv / 1e9:.2f} GB: "
        f"only its {layout.count(FULL)} full-attention "
        f"layers ({layout.kv_heads} KV heads x {layout.head_dim}) store keys and values; "
        f"its {layout.count(LINEAR)} Gated DeltaNet "
        f"layers keep a fixed {2 * layout.linear_state_values() / 1e6:.1f} MB state (bf16), "
        "which is not KV; the claimed saving is 14.2 GB"
    )
    if ev.device != "cuda":
        measured += "; peak GPU memory not measured (CPU run)"
    return measured, "refuted" if kv < 14.2e9 else "untestable here (needs CUDA)"


def s0_7(ev):
    d = _drops(ev, "q8_0", "q4_0")
    if d is None:
        return _missing("fp16, q8_0 and q4_0 needle rows")
    measured = (
        "; ".join(_drop_text(m, d[m]) for m in d)
        + f" ({ev.niah['needle_kind'].iloc[0]} needles)"
        + _llamacpp_note(ev, "accuracy")
    )
    parts = {
        "q8_0 keeps accuracy": _drop_verdict(d["q8_0"], 0.05, False),
        "q4_0 collapses it": _drop_verdict(d["q4_0"], 0.3, True),
    }
    return measured, _combine(parts)


def s0_8(ev):
    if ev.kv_value_share is None:
        return _missing("K/V value histogram")
    share = 100 * ev.kv_value_share
    verdict = "supported" if abs(share - 99.2) <= 1.0 else ("partly" if share > 99.2 else "refuted")
    return f"{share:.2f}% of K and V values lie in [-6, 6]", verdict


def s0_9(ev):
    if not len(ev.sweep):
        return _missing("pressure sweep")
    lengths = sorted(ev.sweep["length"].unique())
    measured = (
        f"{len(lengths)} steps from {lengths[0]} to {lengths[-1]} tokens; KV bytes, peak memory, TTFT, TPOT recorded; "
        "memory bandwidth not recorded"
    )
    return measured, "partly"


def s0_10(ev):
    if not len(ev.sweep):
        return _missing("pressure sweep")
    b = breathing(ev.sweep)
    if not len(b):
        return "traces too short to analyse", "untestable here (memory traces shorter than 8 samples)"
    periodic = b[b["period_s"].notna()]
    near = int(((periodic["period_s"] - 0.237).abs() <= 0.05).sum())
    lo, hi = wilson_interval(near, len(b))
    measured = (
        f"{near} of {len(b)} traces have a period within 50 ms of 237 ms (share [{lo:.2f}, {hi:.2f}], 95% Wilson), "
        f"{len(periodic)} periodic at all; "
        f"median amplitude {b['amplitude_MiB'].median():.1f} MiB ({ev.sweep['memory_source'].iloc[0]})"
    )
    return measured, _single(
        interval_verdict(lo, hi, 0.5, True), f"n={len(b)} traces, share {near / len(b):.2f} [{lo:.2f}, {hi:.2f}]"
    )


def _deltas(ev, method):
    s = ev.sweep_method(method).set_index("length")["kv_bytes"]
    if not {4096, 8192, 16384} <= set(s.index):
        return None
    return (s[16384] - s[8192]) / (s[8192] - s[4096])


def s0_11(ev):
    methods = [m for m in ev.sweep["method"].unique()] if len(ev.sweep) else []
    ratios = {m: _deltas(ev, m) for m in methods}
    ratios = {m: r for m, r in ratios.items() if r is not None}
    if not ratios:
        return _missing("sweep steps at 4K, 8K and 16K")
    measured = "marginal bytes (8K->16K)/(4K->8K): " + ", ".join(f"{m} {r:.2f}" for m, r in ratios.items())
    return measured, "refuted" if all(abs(r - 2) < 0.05 for r in ratios.values()) else "partly"


def s0_12(ev):
    if not len(ev.sweep):
        return _missing("pressure sweep")
    ok = ev.sweep[ev.sweep["status"] == "ok"]
    spread = ok.groupby("length")["ttft_s"].agg(lambda t: t.max() / t.min())
    at = spread[spread.index >= 4096]
    if not len(at):
        return _missing("sweep steps of 4K or more")
    worst = float(at.max())
    measured = (
        f"TTFT max/min across methods at >= 4K: {worst:.2f}, "
        "one TTFT per method and length (CPU: shapes, not absolute seconds)"
    )
    return measured, "inconclusive (no spread measured: one TTFT per method and length)"


def s0_13(ev):
    ref, q8 = ev.sweep_method("fp16"), ev.sweep_method("q8_0")
    if not len(ref) or not len(q8):
        return _missing("fp16 and q8_0 sweep rows")
    L = min(ref["length"].max(), q8["length"].max())
    row = q8.set_index("length").loc[L]
    ratio, lo, hi, rounds = (
        row["tpot_vs_ref"],
        row.get("tpot_vs_ref_low"),
        row.get("tpot_vs_ref_high"),
        row["decode_steps"],
    )
    spread = not (pd.isna(lo) or pd.isna(hi))
    measured = (
        f"q8_0 TPOT / fp16 TPOT at {L} tokens = {ratio:.2f}"
        + (f" [{lo:.2f}, {hi:.2f}] (95% bootstrap over rounds)" if spread else "")
        + f", median of {rounds} paired rounds, against this repo's fp16 cache "
        "(cast to fp32 at each step, not a tuned fp16 kernel); "
        "q8_0 is attended from its codes" + _llamacpp_note(ev, "decode")
    )
    if not spread:
        return measured, "inconclusive (no spread measured: one median ratio per step)"
    return measured, _single(
        interval_verdict(lo, hi, 0.85, False), f"n={rounds} rounds, TPOT ratio {ratio:.2f} [{lo:.2f}, {hi:.2f}]"
    )


def s0_14(ev):
    q8 = ev.niah_method("q8_0")
    if not len(q8):
        return _missing("q8_0 rows")
    per_question = q8["kl_vs_ref"].dropna()
    kl, lo, hi = paired_bootstrap(per_question)
    measured = (
        f"mean KL(fp16 || q8_0) over answer positions = {kl:.2e} [{lo:.2e}, {hi:.2e}] "
        f"(95% bootstrap over {len(per_question)} questions), "
        f"top-1 agreement {q8['top1_vs_ref'].mean():.3f}" + _llamacpp_note(ev, "kl")
    )
    return measured, _single(
        interval_verdict(lo, hi, 0.05, False), f"n={len(per_question)}, mean KL {kl:.3f} [{lo:.3f}, {hi:.3f}]"
    )


def s0_15(ev):
    cw = ev.cold_warm
    if not cw:
        return _missing("cold/warm TTFT probe")
    if "cold_s" in cw:  # repeated fresh processes
        target, warmup, cold, warm = (
            cw["target"],
            cw["warmup"],
            np.asarray(cw["cold_s"], float),
            np.asarray(cw["warm_s"], float),
        )
    else:  # one cold and one warm process
        target, warmup, cold, warm = (
            cw["cold"]["target"],
            cw["warm"]["warmup"],
            np.array([cw["cold"]["ttft_s"]]),
            np.array([cw["warm"]["ttft_s"]]),
        )
    r = 1 - np.median(warm) / np.median(cold)
    rng = np.random.default_rng(0)
    draws = 1 - np.median(rng.choice(warm, (BOOTSTRAP, len(warm))), axis=1) / np.median(
        rng.choice(cold, (BOOTSTRAP, len(cold))), axis=1
    )
    lo, hi = np.quantile(draws, [0.025, 0.975])
    n = f"n={len(cold)} cold and {len(warm)} warm runs"
    measured = (
        f"a {warmup}-token warm-up cut the first {target}-token TTFT by {r:.0%} (1 - median warm / median cold, {n}"
        + (f"; 95% bootstrap interval [{lo:.0%}, {hi:.0%}])" if min(len(cold), len(warm)) > 1 else ")")
    )
    if target != 16384:
        return measured, f"inconclusive (measured at {target}, the claim is about 16384)"
    if min(len(cold), len(warm)) < 2:
        return measured, f"inconclusive ({n}: no spread)"
    if 0.12 <= lo and hi <= 0.32:
        return measured, "supported"
    if hi < 0.12 or lo > 0.32:
        return measured, "refuted"
    return measured, f"inconclusive ({n}, reduction {r:.2f} [{lo:.2f}, {hi:.2f}])"


# The ledger's binding: claim ID of claims/claims.yaml -> its evaluator (read by niah.report.claims.load_claims).
EVALUATORS = {
    "S0-1": s0_1,
    "S0-2": s0_2,
    "S0-3": s0_3,
    "S0-4": s0_4,
    "S0-5": s0_5,
    "S0-6": s0_6,
    "S0-7": s0_7,
    "S0-8": s0_8,
    "S0-9": s0_9,
    "S0-10": s0_10,
    "S0-11": s0_11,
    "S0-12": s0_12,
    "S0-13": s0_13,
    "S0-14": s0_14,
    "S0-15": s0_15,
}
