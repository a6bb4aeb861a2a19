"""The ledger covers every seed claim, and each verdict follows its measured input."""

import math
from pathlib import Path

import pandas as pd
import pytest

from niah import claims
from niah.claims import Evidence, claim_ids, ledger

SEED_CLAIMS = Path(__file__).resolve().parents[2] / "shared" / "seed-claims.md"


def _niah(**methods):
    """Rows for methods given as name=(accuracy, bits, kl, logprob)."""
    rows = []
    for name, (acc, bits, kl, lp) in methods.items():
        for i in range(10):
            rows.append({"method": name, "status": "ok", "score": float(i < acc * 10), "bits_per_value": bits,
                         "kl_vs_ref": kl, "top1_vs_ref": 1.0, "answer_logprob": lp, "needle_kind": "number"})
    return pd.DataFrame(rows)


def _sweep(bytes_per_token: dict, tpot: dict, ttft_extra: dict, power: float = 1.0):
    rows = []
    for m, bpt in bytes_per_token.items():
        for L in (1, 1024, 4096, 8192, 16384):
            rows.append({"method": m, "length": L, "status": "ok", "kv_bytes": bpt * L**power, "ttft_s": 1e-4 * L + ttft_extra[m],
                         "tpot_median_s": tpot[m], "tpot_vs_ref": tpot[m] / tpot["fp16"], "trace_t": [], "trace_bytes": [], "memory_source": "process RSS"})
    return pd.DataFrame(rows)


def verdict(cid, ev):
    row = ledger(ev).set_index("id").loc[cid]
    return row["verdict"].split(" ")[0]


@pytest.mark.skipif(not SEED_CLAIMS.exists(), reason="the steering repo's shared/ is not beside this checkout")
def test_every_seed_claim_has_a_ledger_entry():
    assert claim_ids(SEED_CLAIMS) == list(ledger(Evidence("x"))["id"])


def test_without_measurements_nothing_is_decided_but_arithmetic():
    table = ledger(Evidence("x")).set_index("id")
    decided = set(table[~table["verdict"].str.startswith("untestable")].index)
    assert decided <= {"S0-2", "S0-4", "S0-6", "S1-2", "S1-4", "S3-7", "S3-8"}


@pytest.mark.parametrize(
    "cid, good, bad",
    [
        ("S0-7", _niah(fp16=(1, 16, 0, -1), q8_0=(1, 8.5, 1e-3, -1), q4_0=(0.3, 4.5, 0.5, -5)),
         _niah(fp16=(1, 16, 0, -1), q8_0=(1, 8.5, 1e-3, -1), q4_0=(1, 4.5, 0.01, -1))),
        ("S0-14", _niah(fp16=(1, 16, 0, -1), q8_0=(1, 8.5, 0.01, -1)), _niah(fp16=(1, 16, 0, -1), q8_0=(1, 8.5, 0.2, -1))),
        ("S1-1", _niah(turbo3=(1, 2.0, 0, -1)), _niah(turbo3=(1, 3.2, 0, -1))),
        ("S0-3", _niah(q8_0=(1, 3.7, 0, -1)), _niah(q8_0=(1, 8.5, 0, -1))),
        ("S3-9", _niah(fp8_e4m3=(1, 8, 0.02, -1), fp8_e5m2=(1, 8, 0.01, -1)), _niah(fp8_e4m3=(1, 8, 0.01, -1), fp8_e5m2=(1, 8, 0.02, -1))),
        ("S1-5", _niah(fp16=(1, 16, 0, -1), turbo3=(1, 3.1, 0, -1)), _niah(fp16=(1, 16, 0, -1), turbo3=(0.5, 3.1, 0, -1))),
    ],
)
def test_needle_verdicts_follow_the_measurements(cid, good, bad):
    assert verdict(cid, Evidence("x", niah=good)) != verdict(cid, Evidence("x", niah=bad))


def test_sweep_verdicts_follow_the_measurements():
    linear = _sweep({"fp16": 100, "q8_0": 53}, {"fp16": 1.0, "q8_0": 0.7}, {"fp16": 0, "q8_0": 0})
    curved = _sweep({"fp16": 1, "q8_0": 0.5}, {"fp16": 1.0, "q8_0": 1.4}, {"fp16": 0, "q8_0": 5}, power=2)
    for cid in ("S0-5", "S0-11", "S0-12", "S0-13"):
        assert verdict(cid, Evidence("x", sweep=linear)) != verdict(cid, Evidence("x", sweep=curved)), cid


def _kv_ppl(**ratios):
    """Perplexity rows: fp16 and each method at a perplexity ``ratio`` times fp16's, over 6 windows of 100 tokens."""
    rows = []
    for m, ratio in {"fp16": 1.0, **ratios}.items():
        for w in range(6):
            rows.append({"method": m, "window": w, "status": "ok", "nll_sum": 200.0 + w + 100 * math.log(ratio), "scored_tokens": 100,
                         "kl_vs_ref": 0.0, "top1_vs_ref": 1.0, "bits_per_value": 8.0})
    return pd.DataFrame(rows)


def test_perplexity_verdicts_follow_the_measurements():
    assert verdict("S1-3", Evidence("x", kv_ppl=_kv_ppl(int8_token=1.05))) == "supported"
    assert verdict("S1-3", Evidence("x", kv_ppl=_kv_ppl(int8_token=1.001))) == "refuted"
    needles = _niah(fp16=(1, 16, 0, -1), turbo3=(1, 3.25, 0, -1))
    assert verdict("S1-5", Evidence("x", niah=needles, kv_ppl=_kv_ppl(turbo3=1.2))) == "refuted"
    assert verdict("S1-5", Evidence("x", niah=needles, kv_ppl=_kv_ppl(turbo3=1.0))) == "partly"


def test_other_measured_verdicts_follow_their_inputs():
    assert verdict("S0-8", Evidence("x", kv_value_share=0.992)) != verdict("S0-8", Evidence("x", kv_value_share=0.9))
    warm = lambda r: {"reduction": r, "cold": {"target": 16384}, "warm": {"warmup": 4096}}  # noqa: E731
    assert verdict("S0-15", Evidence("x", cold_warm=warm(0.2))) != verdict("S0-15", Evidence("x", cold_warm=warm(0.0)))
    assert verdict("S0-1", Evidence("x", niah=_niah(fp16=(1, 16, 0, -1)))) != verdict("S0-1", Evidence("x"))


def test_arithmetic_verdicts_follow_the_architecture_numbers(monkeypatch):
    before = {c: verdict(c, Evidence("x")) for c in ("S1-2", "S3-7", "S0-6")}
    monkeypatch.setattr(claims, "LLAMA2_70B", {**claims.LLAMA2_70B, "kv_heads": 64})
    monkeypatch.setattr(claims, "LLAMA3_8B", {**claims.LLAMA3_8B, "kv_heads": 32, "heads": 80})
    monkeypatch.setattr(claims, "QWEN3_30B_A3B", {**claims.QWEN3_30B_A3B, "kv_heads": 40})
    after = {c: verdict(c, Evidence("x")) for c in before}
    assert all(before[c] != after[c] for c in before), (before, after)


def test_a_broken_evaluator_is_reported_not_raised(monkeypatch):
    bad = claims.Claim("S9-1", "1", "x", "x", "x", lambda ev: 1 / 0)
    monkeypatch.setitem(claims.SEEDS, "S9", "none")
    row = ledger(Evidence("x"), extra=[bad]).set_index("id").loc["S9-1"]
    assert row["verdict"].startswith("untestable") and "ZeroDivisionError" in row["measured"]


def _wq(deltas: dict) -> Evidence:
    """Evidence with weight-quantization rows ``{scheme: ppl_delta}`` (plus the fields some claims read)."""
    rows = [{"scheme": s, "status": "ok", "ppl_delta": d, "model": "m", "kurtosis_fp32": 5.0, "kurtosis_max_layer": 9.0,
             "zero_share": 0.0, "zero_by": None} for s, d in deltas.items()]
    return Evidence("x", weightquant=pd.DataFrame(rows))


def test_weight_quantization_verdicts_follow_the_measurements():
    sym, asym = "W8A8 sym per-token", "W8A8 asym per-token"
    assert verdict("S3-1", _wq({sym: 1.2, asym: 0.7})) != verdict("S3-1", _wq({sym: 0.5, asym: 0.9}))
    g = "W4A8 AutoRound g64"
    assert verdict("S3-2", _wq({g: 15.3, g + " +1% int8 channels": 2.1})) != verdict("S3-2", _wq({g: 2.0, g + " +1% int8 channels": 2.5}))
    assert verdict("S3-12", _wq({"W4A16": 1.0})) != verdict("S3-12", _wq({"W4A16": 2.0}))
    names = [f"W3A16 RTN g64 asym{s}" for s in ("", " +1% fp16 by activation", " +1% fp16 by weight", " +1% fp16 by random")]
    assert verdict("S3-5", _wq(dict(zip(names, (40, 10, 35, 38))))) != verdict("S3-5", _wq(dict.fromkeys(names, 40)))


def test_masks_and_autoround_capability_verdicts_follow_the_measurements():
    def masks(act, mag):
        df = pd.DataFrame([{"scheme": f"mask {z}", "status": "ok", "ppl_delta": d, "zero_share": 0.3, "zero_by": z} for z, d in (("activation", act), ("magnitude", mag))])
        return Evidence("x", weightquant=df)

    assert verdict("S3-4", masks(1.4, 5.6)) != verdict("S3-4", masks(9.0, 5.6))

    def check(real):
        df = pd.DataFrame([{"scheme": "auto-round W4A8 check", "status": "ok", "auto_round_version": "0", "presets_w4a8": [],
                            "custom_w4a8_accepted": True, "real_w4a8_export": real}])
        return Evidence("x", weightquant=df)

    assert verdict("S3-10", check(True)) != verdict("S3-10", check(False))
