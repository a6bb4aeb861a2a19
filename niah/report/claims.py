"""The claims ledger: one row per claim ID of the seed articles, with a verdict computed from this run's data.

Each claim has our paraphrase, its seed and section, how it is tested, the threshold that decides the
verdict (written next to it), and an ``evaluate(ev)`` that reads the measured tables in :class:`Evidence`
(or does the arithmetic) and returns ``(measured, verdict)``.  Verdicts are ``supported``, ``refuted``,
``partly``, ``inconclusive (<n and interval>)`` or ``untestable here (<reason>)``; nothing is typed in: change
the measured input and the verdict follows.

A claim tested on noisy data (needle accuracy, KL, perplexity, timings) is ``supported`` or ``refuted`` only
when the 95% interval of the measured quantity lies wholly on one side of the claim's threshold, so that a
handful of questions cannot decide it; otherwise it is ``inconclusive``, with ``n`` and the interval.
``partly`` is left for claims with two parts decided in opposite ways, and for a claim about a method whose
variants (say the paper's code and an engine's preset) are refuted for some and not for others.  Byte counts and bits per value are
deterministic and need no interval.

Architecture numbers of the Llama models come from their ``config.json`` files on the Hugging Face hub (cited
next to each constant); the seeds' Qwen3.5-35B-A3B comes from :func:`niah.kv.layout.qwen3_5_35b_a3b_config`,
with its layer types: only its full-attention layers hold a KV cache.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from ..config import ROOT
from ..experiments.scoring import wilson_interval
from ..kv.layout import FULL, LINEAR, CacheLayout, qwen3_5_35b_a3b_config
from .stats import ALPHA, BOOTSTRAP, PAIR_KEY, interval_verdict, paired_bootstrap, paired_table

# meta-llama/Llama-2-70b-hf config.json: num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8, hidden 8192
LLAMA2_70B = {"layers": 80, "heads": 64, "kv_heads": 8, "head_dim": 128}
# meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8, hidden 4096
LLAMA3_8B = {"layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}


def dense_layout(arch: dict, kv_heads: int | None = None) -> CacheLayout:
    """The cache layout of a model whose every layer is full attention (the Llama configs above)."""
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
    llamacpp: pd.DataFrame = field(default_factory=pd.DataFrame)  # niah.experiments.llamacpp rows (llama.cpp's own caches)

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


def _combine(parts: dict[str, tuple[str, str]]) -> str:
    """One verdict from a two-part claim's ``{part: (verdict, detail)}``: the parts' verdict when they agree,
    ``partly`` when one is supported and the other refuted, else ``inconclusive``; naming each part then."""
    words = {v for v, _ in parts.values()}
    if len(words) == 1 and words <= {"supported", "refuted"}:
        return words.pop()
    each = "; ".join(f"{name}: {_single(v, detail)}" for name, (v, detail) in parts.items())
    return f"{'partly' if words == {'supported', 'refuted'} else 'inconclusive'} ({each})"


def _drops(ev: Evidence, *methods: str, ref: str = "fp16") -> dict[str, dict] | None:
    """Per method, :func:`niah.report.stats.paired_table`'s row against ``ref`` over every question both answered, with
    the accuracy ``drop`` (ref - method) and its 95% interval ``drop_low``, ``drop_high`` (None unless every
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
        phi = (max(cross - n / 2, 0) if cross >= 0 else cross) / math.sqrt(margins) if margins else 0.0  # his corrected correlation
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
    if d["drop_low"] > threshold and d["p"] >= ALPHA:
        verdict = "inconclusive"
    return verdict, f"n={d['n']}, accuracy drop {d['drop']:.2f} [{d['drop_low']:.2f}, {d['drop_high']:.2f}]"


def _llamacpp_note(ev: Evidence, what: str) -> str:
    """One clause of llama.cpp's own evidence for a claim (empty when the cross-check did not run): ``what`` is
    ``accuracy`` (q8_0 and q4_0 against llama.cpp's f16 on the same questions), ``kl``, ``decode`` or ``memory``."""
    df = ev.llamacpp
    if not len(df) or "lcpp_f16" not in set(df["method"]):
        return ""
    from ..experiments.llamacpp import speed_table

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
            f"q8_0 / f16 decode time per token = {row['decode_vs_f16']:.2f} at {L} tokens (medians of {int(row['n'])} questions)"
            if what == "decode"
            else f"session state at {L} tokens: q8_0 {row['state_mib']:.1f} MiB, f16 {f16['state_mib']:.1f} MiB"
        )
    return f"; llama.cpp itself (same GGUF and token ids, {int((ok['method'] == 'lcpp_f16').sum())} questions): {body}"


def _drop_text(method: str, d: dict) -> str:
    return (
        f"{method} accuracy {d['accuracy']:.2f} [{d['ci_low']:.2f}, {d['ci_high']:.2f}] vs fp16 {d['ref_accuracy']:.2f} on the same "
        f"{d['n']} questions: drop {d['drop']:+.2f} [{d['drop_low']:+.2f}, {d['drop_high']:+.2f}] "
        f"({d['losses']} lost, {d['gains']} gained, "
        f"McNemar p = {d['p']:.2g}), answer log-prob {d['logprob_diff']:+.2f} [{d['logprob_low']:+.2f}, {d['logprob_high']:+.2f}]"
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


# ---- evaluators: each returns (measured, verdict) -------------------------------------------------


def s0_1(ev):
    n = len(ev.niah[ev.niah["status"] == "ok"]) if len(ev.niah) else 0
    if not n:
        return _missing("needle grid")
    return f"{n} needle-in-a-haystack cells retrieved and scored", "refuted"


def s0_2(ev):
    import torch

    from ..kv.registry import get_method

    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    p = get_method("q8_0").key.quantize(x)
    per = x.numel() / p.tensors["scales"].numel()
    return (
        f"our q8_0 (bit-exact with gguf.quants, see tests) keeps one fp16 scale per {per:.0f} values" + _llamacpp_note(ev, "memory"),
        "refuted" if per < x.numel() else "supported",
    )


def s0_3(ev):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K]
    q4k_bits = 8 * size / block
    q8 = ev.niah_method("q8_0")
    if not len(q8):
        return _missing("q8_0 rows")
    q8_bits = float(q8["bits_per_value"].mean())
    change = q8_bits / q4k_bits - 1
    verdict = "supported" if -0.22 <= change <= -0.12 else "refuted"
    return f"q8_0 stores {q8_bits:.2f} bits/value, q4_K {q4k_bits:.2f}: q8_0 uses {change:+.0%} memory" + _llamacpp_note(
        ev, "memory"
    ), verdict


def s0_4(ev):
    page, row = 4096, 16384 * 128 * 2
    waste = (-row) % page
    measured = f"(16384, 128) fp16 = {row / 2**20:.2f} MiB = {row // page} whole 4 KiB pages, alignment waste {waste} B"
    ref = ev.sweep_method("fp16").set_index("length") if len(ev.sweep) else None
    if ref is not None and {4096, 16384} <= set(ref.index):
        measured += f"; measured KV bytes 16K/4K = {ref.loc[16384, 'kv_bytes'] / ref.loc[4096, 'kv_bytes']:.3f}"
    return measured, "refuted" if waste == 0 and 6.8e6 > row * 1.05 else "supported"


def s0_5(ev):
    from .analysis import sweep_fits

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
        f"the whole fp16 KV cache of Qwen3.5-35B-A3B at 16K is {kv / 1e9:.2f} GB: only its {layout.count(FULL)} full-attention "
        f"layers ({layout.kv_heads} KV heads x {layout.head_dim}) store keys and values; its {layout.count(LINEAR)} Gated DeltaNet "
        f"layers keep a fixed {2 * layout.linear_state_values() / 1e6:.1f} MB state (bf16), which is not KV; the claimed saving is 14.2 GB"
    )
    if ev.device != "cuda":
        measured += "; peak GPU memory not measured (CPU run)"
    return measured, "refuted" if kv < 14.2e9 else "untestable here (needs CUDA)"


def s0_7(ev):
    d = _drops(ev, "q8_0", "q4_0")
    if d is None:
        return _missing("fp16, q8_0 and q4_0 needle rows")
    measured = "; ".join(_drop_text(m, d[m]) for m in d) + f" ({ev.niah['needle_kind'].iloc[0]} needles)" + _llamacpp_note(ev, "accuracy")
    parts = {"q8_0 keeps accuracy": _drop_verdict(d["q8_0"], 0.05, False), "q4_0 collapses it": _drop_verdict(d["q4_0"], 0.3, True)}
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
    from .analysis import breathing

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
    return measured, _single(interval_verdict(lo, hi, 0.5, True), f"n={len(b)} traces, share {near / len(b):.2f} [{lo:.2f}, {hi:.2f}]")


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
    measured = f"TTFT max/min across methods at >= 4K: {worst:.2f}, one TTFT per method and length (CPU: shapes, not absolute seconds)"
    return measured, "inconclusive (no spread measured: one TTFT per method and length)"


def s0_13(ev):
    ref, q8 = ev.sweep_method("fp16"), ev.sweep_method("q8_0")
    if not len(ref) or not len(q8):
        return _missing("fp16 and q8_0 sweep rows")
    L = min(ref["length"].max(), q8["length"].max())
    row = q8.set_index("length").loc[L]
    ratio, lo, hi, rounds = row["tpot_vs_ref"], row.get("tpot_vs_ref_low"), row.get("tpot_vs_ref_high"), row["decode_steps"]
    spread = not (pd.isna(lo) or pd.isna(hi))
    measured = (
        f"q8_0 TPOT / fp16 TPOT at {L} tokens = {ratio:.2f}"
        + (f" [{lo:.2f}, {hi:.2f}] (95% bootstrap over rounds)" if spread else "")
        + f", median of {rounds} paired rounds, against this repo's fp16 cache (cast to fp32 at each step, not a tuned fp16 kernel); "
        "q8_0 is attended from its codes" + _llamacpp_note(ev, "decode")
    )
    if not spread:
        return measured, "inconclusive (no spread measured: one median ratio per step)"
    return measured, _single(interval_verdict(lo, hi, 0.85, False), f"n={rounds} rounds, TPOT ratio {ratio:.2f} [{lo:.2f}, {hi:.2f}]")


def s0_14(ev):
    q8 = ev.niah_method("q8_0")
    if not len(q8):
        return _missing("q8_0 rows")
    per_question = q8["kl_vs_ref"].dropna()
    kl, lo, hi = paired_bootstrap(per_question)
    measured = (
        f"mean KL(fp16 || q8_0) over answer positions = {kl:.2e} [{lo:.2e}, {hi:.2e}] (95% bootstrap over {len(per_question)} questions), "
        f"top-1 agreement {q8['top1_vs_ref'].mean():.3f}" + _llamacpp_note(ev, "kl")
    )
    return measured, _single(interval_verdict(lo, hi, 0.05, False), f"n={len(per_question)}, mean KL {kl:.3f} [{lo:.3f}, {hi:.3f}]")


def s0_15(ev):
    cw = ev.cold_warm
    if not cw:
        return _missing("cold/warm TTFT probe")
    if "cold_s" in cw:  # repeated fresh processes
        target, warmup, cold, warm = cw["target"], cw["warmup"], np.asarray(cw["cold_s"], float), np.asarray(cw["warm_s"], float)
    else:  # one cold and one warm process
        target, warmup, cold, warm = (
            cw["cold"]["target"],
            cw["warm"]["warmup"],
            np.array([cw["cold"]["ttft_s"]]),
            np.array([cw["warm"]["ttft_s"]]),
        )
    r = 1 - np.median(warm) / np.median(cold)
    rng = np.random.default_rng(0)
    draws = 1 - np.median(rng.choice(warm, (BOOTSTRAP, len(warm))), axis=1) / np.median(rng.choice(cold, (BOOTSTRAP, len(cold))), axis=1)
    lo, hi = np.quantile(draws, [0.025, 0.975])
    n = f"n={len(cold)} cold and {len(warm)} warm runs"
    measured = f"a {warmup}-token warm-up cut the first {target}-token TTFT by {r:.0%} (1 - median warm / median cold, {n}" + (
        f"; 95% bootstrap interval [{lo:.0%}, {hi:.0%}])" if min(len(cold), len(warm)) > 1 else ")"
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


def _variant(ev: Evidence, method: str) -> str:
    """``method`` named with the read mode and layer policy its needle rows record (the bare name without them)."""
    rows = ev.niah_method(method)
    if not len(rows) or "read_mode" not in rows:
        return method
    return f"{method} (read {rows['read_mode'].iloc[0]}, {rows['layer_policy'].iloc[0]})"


def s1_1(ev):
    """Decided on ``turbo3``, the paper's 3-bit code on every layer; vLLM's ``turboquant_3bit_nc`` is reported beside
    it, over the whole cache (its layer policy leaves some layers at fp16) and on the layers it codes."""
    t3 = ev.niah_method("turbo3")
    if not len(t3):
        return _missing("turbo3 rows")
    bits = float(t3["bits_per_value"].mean())
    measured = f"turbo3 stores {bits:.2f} bits/value: {16 / bits:.2f}x smaller than fp16 (ceiling 16/3 = 5.33x)"
    vllm = ev.niah_method("turboquant_3bit_nc")
    if len(vllm):
        whole, coded = float(vllm["bits_per_value"].mean()), float(vllm["analytical_bits"].iloc[0])
        measured += (
            f"; vLLM's {_variant(ev, 'turboquant_3bit_nc')} stores {whole:.2f} bits/value over the whole cache "
            f"({16 / whole:.2f}x) and {coded:.2f} on the layers it codes ({16 / coded:.2f}x)"
        )
    return measured, "refuted" if 16 / bits < 8 else "supported"


def s1_2(ev):
    layout = dense_layout(LLAMA2_70B)
    per, total = layout.kv_bytes(1, 16)["total"], layout.kv_bytes(32768, 16)["total"]
    ok_token = per == 327_680
    measured = f"{per:,.0f} B/token (2 x 80 layers x 8 KV heads x 128 x 2 B); at 32K {total / 1e9:.2f} GB = {total / 2**30:.2f} GiB"
    close_total = min(abs(total / 1e9 - 10.5), abs(total / 2**30 - 10.5)) / 10.5 <= 0.02
    return measured, "supported" if ok_token and close_total else ("partly" if ok_token else "refuted")


def _ppl(ev: Evidence) -> pd.DataFrame | None:
    """:func:`niah.experiments.kvppl.perplexity_table` of this run, indexed by method (None without an fp16 reference)."""
    from ..experiments.kvppl import perplexity_table

    if not len(ev.kv_ppl) or "fp16" not in set(ev.kv_ppl["method"]):
        return None
    return perplexity_table(ev.kv_ppl, "fp16").set_index("method")


def _ppl_text(table: pd.DataFrame, method: str) -> str:
    r = table.loc[method]
    return f"{method} {100 * (r['ppl_vs_ref'] - 1):+.2f}% [{100 * (r['ci_low'] - 1):+.2f}, {100 * (r['ci_high'] - 1):+.2f}]"


def _ppl_verdict(table: pd.DataFrame, method: str, claim_holds_above: bool) -> tuple[str, str]:
    """(verdict, detail) on "``method`` costs more than 1% perplexity" (or less) from the bootstrap interval over windows."""
    r = table.loc[method]
    return interval_verdict(
        r["ci_low"], r["ci_high"], 1.01, claim_holds_above
    ), f"n={int(r['windows'])} windows, perplexity {_ppl_text(table, method)}"


def s1_3(ev):
    table = _ppl(ev)
    if table is None or "int8_token" not in table.index:
        return _missing("perplexity rows of fp16 and int8_token")
    r = table.loc["int8_token"]
    others = [_ppl_text(table, m) for m in ("q8_0", "fp8_e4m3") if m in table.index]
    measured = (
        f"perplexity vs fp16 over {int(r['scored_tokens'])} held-out tokens in {int(r['windows'])} windows "
        f"(95% bootstrap interval over windows): " + ", ".join([_ppl_text(table, "int8_token"), *others])
    )
    return measured, _single(*_ppl_verdict(table, "int8_token", True))


def s1_4(ev):
    from ..kv.registry import available

    have = {"turbo3", "sliding_window_asym3"} <= set(available())
    if not have:
        return _missing("turbo3 and sliding_window_asym3 methods")
    kl = {m: float(ev.niah_method(m)["kl_vs_ref"].mean()) for m in ("turbo3", "sliding_window_asym3") if len(ev.niah_method(m))}
    measured = "the paper's TurboQuant (rotation + Lloyd-Max codebook) and the seed's sliding-window min/max are different algorithms"
    if len(kl) == 2:
        measured += f"; KL vs fp16: turbo3 {kl['turbo3']:.2e}, sliding_window_asym3 {kl['sliding_window_asym3']:.2e}"
    return measured, "refuted"


S1_5_VARIANTS = ("turbo3", "turboquant_3bit_nc", "turboquant_3bit_nc@engine")  # the paper's code; vLLM's preset, two reads


def _no_loss_parts(ev: Evidence, method: str, d: dict, table: pd.DataFrame | None) -> tuple[dict, str]:
    """S1-5's parts for one 3-bit variant (``{part: (verdict, detail)}``) and its measured text."""
    parts = {"no needle loss": _drop_verdict(d, 0.1, False)}
    measured = _drop_text(_variant(ev, method), d)
    if table is not None and method in table.index:
        parts["no perplexity loss"] = _ppl_verdict(table, method, False)
        measured += f"; perplexity vs fp16: {_ppl_text(table, method)}"
    else:
        measured += "; perplexity not measured"
    return parts, measured


def s1_5(ev):
    """Each 3-bit TurboQuant variant of :data:`S1_5_VARIANTS` that ran is judged on its own: ``refuted`` when every
    one loses needles or perplexity, ``partly`` when some do and others do not, else ``inconclusive`` (code
    completion is never measured)."""
    ran = [m for m in S1_5_VARIANTS if len(ev.niah_method(m))]
    d = _drops(ev, *ran) if ran else None
    if d is None:
        return _missing("turbo3 and fp16 rows")
    table = _ppl(ev)
    judged = {m: _no_loss_parts(ev, m, d[m], table) for m in ran}
    measured = "; ".join(text for _, text in judged.values()) + "; code completion not measured"
    refuted = [m for m, (parts, _) in judged.items() if any(v == "refuted" for v, _ in parts.values())]
    kept = {m: parts for m, (parts, _) in judged.items() if m not in refuted}
    name = (lambda m: f"{m}: ") if len(ran) > 1 else (lambda m: "")
    each = "; ".join(name(m) + "; ".join(f"{p}: {_single(v, x)}" for p, (v, x) in parts.items()) for m, parts in kept.items())
    if not kept:
        return measured, "refuted"
    if refuted:
        return measured, f"partly (refuted for {', '.join(refuted)}; code completion not measured; {each})"
    return measured, f"inconclusive (code completion not measured; {each})"


def s1_6(ev):
    """Supported when fp4_e2m1 ran: in the needle rows (accuracy) or, where the chain ran it only there, the
    perplexity-through-cache rows (perplexity against fp16)."""
    fp4 = ev.niah_method("fp4_e2m1")
    what = "fp4_e2m1 (1 sign, 2 exponent, 1 mantissa bit, fp16 scale per 32)"
    if len(fp4):
        lo, hi = wilson_interval(fp4["score"].sum(), len(fp4))
        return (
            f"{what} stores {fp4['bits_per_value'].mean():.2f} bits/value, "
            f"needle accuracy {fp4['score'].mean():.2f} [{lo:.2f}, {hi:.2f}] (n={len(fp4)})"
        ), "supported"
    table = _ppl(ev)
    if table is None or "fp4_e2m1" not in table.index:
        return _missing("fp4_e2m1 needle or perplexity rows")
    bits = table.loc["fp4_e2m1", "bits_per_value"]
    return f"{what} stores {bits:.2f} bits/value, perplexity vs fp16: {_ppl_text(table, 'fp4_e2m1')}", "supported"


def s3_6(ev):
    return "", "untestable here (FlashAttention-3 needs a Hopper GPU)"


def s3_7(ev):
    gqa = dense_layout(LLAMA3_8B).kv_bytes(2048, 16)["total"]
    mha = dense_layout(LLAMA3_8B, kv_heads=LLAMA3_8B["heads"]).kv_bytes(2048, 16)["total"]
    measured = f"Llama-3-8B fp16 KV at 2048 tokens: {gqa / 1e6:.0f} MB with its 8 KV heads, {mha / 1e9:.2f} GB if all 32 heads had KV"
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
        f"KL vs fp16 on the same {len(kl)} questions: e4m3 {kl['fp8_e4m3'].mean():.2e}, e5m2 {kl['fp8_e5m2'].mean():.2e}, "
        f"e5m2 - e4m3 {diff:+.2e} [{lo:+.2e}, {hi:+.2e}] (95% paired bootstrap); '5-bit exponent + 2-bit mantissa' is e5m2, "
        "vLLM's default fp8 KV dtype is e4m3"
    )
    if lo > 0:  # e4m3, vLLM's default, is the better one
        return measured, "partly"
    return measured, "supported" if hi < 0 else f"inconclusive (n={len(kl)}, KL e5m2 - e4m3 {diff:+.2e} [{lo:+.2e}, {hi:+.2e}])"


def _wq(ev: Evidence, scheme: str) -> pd.Series | None:
    """The weight-quantization row of ``scheme`` (status ok), or None."""
    df = ev.weightquant
    if not len(df) or "scheme" not in df:
        return None
    rows = df[(df["scheme"] == scheme) & (df["status"] == "ok")]
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
    measured = f"perplexity +{sym:.2f} (symmetric per-channel weights) and +{asym:.2f} (asymmetric), simulated int8 activations"
    return measured, "supported" if close else ("partly" if asym < sym else "refuted")


def s3_2(ev):
    rows = _wq_rows(ev, "W4A8 AutoRound g64", "W4A8 AutoRound g64 +1% int8 channels")
    if rows is None:
        return _missing("W4A8 rows")
    plain, kept = (float(r["ppl_delta"]) for r in rows)
    measured = f"W4A8 (AutoRound int4 g64, simulated int8 activations): +{plain:.2f} perplexity; with 1% int8 input channels +{kept:.2f}"
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
        f"30% of input channels zeroed by activation salience: +{act:.2f} perplexity; 30% magnitude pruning: +{mag:.2f}; no fine-tuning"
    )
    if abs(act - 1.4) <= 0.7 and mag > act:
        return measured, "supported"
    return measured, "partly" if act < mag else "refuted"


def s3_5(ev):
    verdicts, parts = [], []
    for b in (3, 4):
        rows = _wq_rows(
            ev, *(f"W{b}A16 RTN g64 asym" + s for s in ("", " +1% fp16 by activation", " +1% fp16 by weight", " +1% fp16 by random"))
        )
        if rows is None:
            continue
        plain, act, wt, rnd = (float(r["ppl_delta"]) for r in rows)
        parts.append(f"W{b}: +{plain:.2f} -> +{act:.2f} protecting 1% by activation (by weight +{wt:.2f}, random +{rnd:.2f})")
        verdicts.append(act < 0.6 * plain and act < min(wt, rnd))
    if not verdicts:
        return _missing("salient-channel rows")
    return "; ".join(parts), "supported" if all(verdicts) else ("partly" if any(verdicts) else "refuted")


def s3_10(ev):
    check = _wq(ev, "auto-round W4A8 check")
    if check is None:
        return _missing("auto-round capability check")
    measured = (
        f"auto-round {check['auto_round_version']}: W4A8 presets {list(check['presets_w4a8']) or 'none'}; a custom act_bits=8 scheme "
        f"{'is accepted' if check['custom_w4a8_accepted'] else 'is refused'}; real W4A8 export: {bool(check['real_w4a8_export'])}"
    )
    if check["custom_w4a8_accepted"] and check["real_w4a8_export"]:
        return measured, "supported"
    return measured, "partly" if check["custom_w4a8_accepted"] else "refuted"


def s3_11(ev):
    df = ev.weightquant
    if not len(df) or "kurtosis_fp32" not in df:
        return _missing("kurtosis rows")
    w4a8 = df[(df["scheme"] == "W4A8 AutoRound g64") & (df["status"] == "ok")].drop_duplicates("model", keep="last")
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
        f"{within} of {len(q)} quantized configurations within +1.5 perplexity; worst {worst['scheme']} +{worst['ppl_delta']:.1f}",
        "supported" if within == len(q) else "refuted",
    )


CLAIMS_FILE = ROOT / "claims" / "claims.yaml"


def load_claims(path: Path = CLAIMS_FILE) -> list[Claim]:
    """The claims of ``claims/claims.yaml``, each bound to its evaluator (``s0_7`` for ``S0-7``)."""
    import yaml

    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    evaluators = {name: f for name, f in globals().items() if re.fullmatch(r"s\d_\d+", name)}
    claims = []
    for c in doc["claims"]:
        name = c["id"].lower().replace("-", "_")
        if name not in evaluators:
            raise ValueError(f"{path}: claim {c['id']} has no evaluator {name}() in niah/report/claims.py")
        article = doc["articles"][c["id"].split("-")[0]]["file"]
        claims.append(Claim(c["id"], article, str(c["section"]), c["claim"], c["test"], c["threshold"], evaluators.pop(name)))
    if evaluators:
        raise ValueError(f"{path} lacks the claims of evaluators {sorted(evaluators)}")
    return claims


CLAIMS = load_claims()


def ledger(ev: Evidence, extra: list[Claim] = ()) -> pd.DataFrame:
    """One row per claim: id, seed, section, claim, test, threshold, measured, verdict, config, commit."""
    rows = []
    for c in [*CLAIMS, *extra]:
        try:
            measured, verdict = c.evaluate(ev)
        except Exception as err:  # a broken evaluator must not hide the others
            measured, verdict = f"evaluation failed: {type(err).__name__}: {err}", "untestable here (evaluation error)"
        rows.append(
            {
                "id": c.id,
                "seed": c.seed,
                "section": c.section,
                "claim": c.claim,
                "test": c.test,
                "threshold": c.threshold,
                "measured": measured,
                "verdict": verdict,
                "config": ev.config,
                "commit": ev.commit,
            }
        )
    df = pd.DataFrame(rows)
    return df.sort_values("id", key=lambda s: s.map(_id_key)).reset_index(drop=True)


def _id_key(cid: str) -> tuple:
    seed, num = re.fullmatch(r"S(\d)-(\d+)", cid).groups()
    return int(seed), int(num)


def gather_evidence(run, kv_value_share: float | None = None) -> Evidence:
    """Read whatever this run measured from the :class:`~niah.rundir.RunDir` ``run`` (missing tables stay empty;
    rows of other settings are left out)."""
    import json

    from ..env import git_commit

    cfg = run.cfg
    return Evidence(
        config=cfg["name"],
        device=cfg["device"],
        commit=git_commit(),
        niah=run.rows("needles"),
        sweep=run.rows("sweep"),
        weightquant=run.rows("weightquant"),
        kv_ppl=run.rows("kv_perplexity"),
        cold_warm=json.loads(run.cold_warm.read_text()) if run.cold_warm.exists() else None,
        kv_value_share=kv_value_share,
        llamacpp=run.rows("llamacpp"),
    )
