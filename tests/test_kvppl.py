"""Perplexity through the stored cache (niah/experiments/kvppl.py)."""

import math

import pandas as pd
import pytest

from niah.config import ConfigError
from niah.experiments.kvppl import run_kv_perplexity
from niah.report.tables import perplexity_table
from niah.results import read_rows
from niah.rundir import TABLES

KEY = TABLES["kv_perplexity"].key


def test_rows_per_method_and_window_and_the_reference_scores_itself(smoke_with, tiny, tmp_path):
    cfg = smoke_with("kv_perplexity")
    rows = read_rows(run_kv_perplexity(cfg, tiny, tmp_path / "p.jsonl", progress=False))
    s = cfg.kv_perplexity
    assert len(rows) == s.windows * len(s.methods)
    for r in rows:
        assert r["scored_tokens"] == s.continuation - 1 and r["nll_sum"] > 0
        assert (r["kl_vs_ref"] == 0 and r["top1_vs_ref"] == 1) if r["method"] == "fp16" else r["kl_vs_ref"] > 0
    table = perplexity_table(pd.DataFrame(rows)).set_index("method")
    assert table.loc["fp16", "ppl_vs_ref"] == 1 and table.loc["fp16", "ci_low"] == table.loc["fp16", "ci_high"] == 1
    assert (
        table.loc["turbo3", "ppl_vs_ref"] != 1
        and table.loc["turbo3", "ci_low"] <= table.loc["turbo3", "ppl_vs_ref"] <= table.loc["turbo3", "ci_high"]
    )
    assert table.loc["int8_token", "bits_per_value"] == pytest.approx(8 + 16 / tiny.head_dim)


def test_a_killed_run_resumes_without_duplicates(smoke_with, tiny, tmp_path, killed_after):
    cfg = smoke_with("kv_perplexity", windows=2)
    path = tmp_path / "p.jsonl"
    kill = killed_after(5)
    with pytest.raises(KeyboardInterrupt):
        run_kv_perplexity(cfg, tiny, path, progress=False)
    kill.revive()
    first = read_rows(path)
    assert len(first) == 5
    rows = read_rows(run_kv_perplexity(cfg, tiny, path, progress=False))
    keys = [tuple(r[k] for k in KEY) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * len(cfg.kv_perplexity.methods)
    again = {(r["method"], r["window"]): r["nll_sum"] for r in rows}
    assert all(
        again[(r["method"], r["window"])] == r["nll_sum"] for r in first
    )  # the resumed window's reference is recomputed alike


def test_ratio_and_interval_follow_the_windows():
    """Window 1 is twice as hard for 'q' as for the reference; the other windows are equal."""
    rows = [
        {
            "method": m,
            "window": w,
            "status": "ok",
            "nll_sum": 10.0 * (2 if (m, w) == ("q", 1) else 1),
            "scored_tokens": 10,
            "kl_vs_ref": 0.0,
            "top1_vs_ref": 1.0,
            "bits_per_value": 16 if m == "fp16" else 4,
        }
        for m in ("fp16", "q")
        for w in range(4)
    ]
    q = perplexity_table(pd.DataFrame(rows)).set_index("method").loc["q"]
    assert q["ppl_vs_ref"] == pytest.approx(math.exp(0.25))  # mean NLL 1.25 against 1.0
    assert q["ci_low"] == pytest.approx(1.0) and q["ci_high"] > q["ppl_vs_ref"]


def test_bad_settings_are_named(smoke_with, tiny, tmp_path):
    with pytest.raises(ConfigError, match="unknown kv_perplexity setting"):
        run_kv_perplexity(smoke_with("kv_perplexity", tokens=3), tiny, tmp_path / "p.jsonl", progress=False)
    with pytest.raises(ConfigError, match="exceeds the model's limit of 2048"):
        run_kv_perplexity(
            smoke_with("kv_perplexity", context=2000, continuation=100), tiny, tmp_path / "p.jsonl", progress=False
        )
    assert not (tmp_path / "p.jsonl").exists()


def test_breakdown_rows_quantize_one_part_each(smoke_with, tmp_path):
    """On a tiny Gemma 3 (layers 0, 1, 3 sliding, 2 full): each breakdown row stores only its part."""
    from conftest import HYBRID_SPECS

    from niah.models import load_model
    from niah.report.plots import loss_breakdown

    lm = load_model(HYBRID_SPECS["gemma3"])
    methods = ["fp16", "q4_0", "turboquant_k3v4_nc+all_layers"]
    cfg = smoke_with("kv_perplexity", methods=methods, windows=2, breakdown=["keys", "values", "full", "sliding"])
    s = cfg.kv_perplexity
    assert s.parts["q4_0+sliding"] == ("q4_0", "sliding") and "turboquant_k3v4_nc+all_layers+full" not in s.parts
    assert s.parts["turboquant_k3v4_nc+all_layers+keys"] == ("turboquant_k3v4_nc+all_layers", "keys")
    rows = {
        r["method"]: r
        for r in read_rows(run_kv_perplexity(cfg, lm, tmp_path / "p.jsonl", progress=False))
        if r["window"] == 0
    }
    assert len(rows) == 3 + 2 * 4 - 2
    fp16, q4 = rows["fp16"], rows["q4_0"]
    assert rows["q4_0+full"]["kv_bytes_sliding_attention"] == fp16["kv_bytes_sliding_attention"]
    assert (
        rows["q4_0+full"]["kv_bytes_full_attention"] == q4["kv_bytes_full_attention"] < fp16["kv_bytes_full_attention"]
    )
    assert rows["q4_0+sliding"]["kv_bytes_full_attention"] == fp16["kv_bytes_full_attention"]
    for part in ("keys", "values", "full", "sliding"):
        r = rows[f"q4_0+{part}"]
        assert q4["bits_per_value"] < r["bits_per_value"] < 16 and r["kl_vs_ref"] > 0
    table = perplexity_table(pd.DataFrame(read_rows(tmp_path / "p.jsonl")))
    fig = loss_breakdown(table, s.parts)
    assert len(fig.axes[0].patches) == 2 * 5  # 2 methods x (all + 4 parts), a missing part drawn as an empty bar


def test_a_continuation_scores_at_least_one_token(smoke_with):
    with pytest.raises(ConfigError, match="kv_perplexity.continuation must be an integer from 2"):
        smoke_with("kv_perplexity", continuation=1)


def test_breakdown_parts_are_checked(smoke_with):
    with pytest.raises(ConfigError, match="unknown kv_perplexity.breakdown part"):
        smoke_with("kv_perplexity", breakdown=["key"]).kv_perplexity
    with pytest.raises(ConfigError, match=r"breakdown_methods \['q8_0'\] are not in kv_perplexity.methods"):
        smoke_with(
            "kv_perplexity", methods=["fp16", "q4_0"], breakdown=["keys"], breakdown_methods=["q8_0"]
        ).kv_perplexity


def test_breakdown_methods_choose_which_listed_methods_get_rows(smoke_with):
    cfg = smoke_with(
        "kv_perplexity", methods=["fp16", "q4_0", "q8_0"], breakdown=["keys", "values"], breakdown_methods=["q4_0"]
    )
    s = cfg.kv_perplexity
    assert s.parts == {"q4_0+keys": ("q4_0", "keys"), "q4_0+values": ("q4_0", "values")}
    assert s.methods == ["fp16", "q4_0", "q8_0", "q4_0+keys", "q4_0+values"]
    preset = smoke_with("kv_perplexity", methods=["fp16", "turboquant_k3v4_nc"], breakdown=["keys", "full", "sliding"])
    assert list(preset.kv_perplexity.parts) == ["turboquant_k3v4_nc+keys"]  # it codes full-attention layers only
