"""The benchmark helpers: what they time and the table they print (no speed targets here)."""

import time

from niah.experiments import bench


def test_paired_ratio_compares_each_run_with_its_neighbouring_reference():
    calls = []

    def ref():
        calls.append("ref")
        time.sleep(0.002)

    def fn():
        calls.append("fn")
        time.sleep(0.006)

    seconds, ratio = bench.paired_ratio(fn, ref, repeat=5)
    assert calls == ["fn", "ref"] + ["ref", "fn"] * 5
    assert 0.006 <= seconds < 0.05
    assert 1.5 < ratio < 6


def test_decode_attention_reports_both_paths_per_method():
    df = bench.decode_attention(["q8_0", "turbo3"], tokens=96, repeat=1)
    assert list(df["path"]) == ["sdpa", "torch.cat + sdpa"] + ["dequantize", "per chunk"] * 2
    assert (df["step_ms"] > 0).all() and df["ratio_to_fp32"].iloc[0] == 1.0


def test_codec_throughput_has_a_row_per_method_and_the_turbo_floors():
    df = bench.codec_throughput(["q4_0"], tokens=64, repeat=1)
    assert list(df["method"]) == [
        "q4_0",
        "rotation matmul alone (TurboQuant's floor)",
        "rotation and QJL matmuls (TurboQuant_prod's floor)",
    ]
    assert (df["quantize_vs_copy"] > 0).all()
