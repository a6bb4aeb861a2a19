"""Notebook 01's weights x KV cells: the battery's questions under each weight scheme, paired with fp32 weights and
the fp16 cache, and the interaction (difference-in-differences) of a KV method with a weight scheme."""

import numpy as np
import pandas as pd
import pytest

from niah.experiments.battery import run_battery
from niah.report.summary import _weights_parts
from niah.report.tables import interaction_table, weights_kv_table
from niah.results import read_rows
from niah.rundir import RunDir
from niah.schema import ConfigError
from niah.weightquant.needle import needle_battery, run_needles
from niah.weightquant.schemes import QuantizedModel, Scheme, rtn_layers


def _rows(weights: str, method: str, logprobs, scores) -> list[dict]:
    return [
        {
            "weights": weights,
            "simulated": False,
            "method": method,
            "status": "ok",
            "prompt_style": "completion",
            "length": 4096,
            "depth": 0.5,
            "trial": t,
            "answer_logprob": lp,
            "score": s,
        }  # fmt: skip
        for t, (lp, s) in enumerate(zip(logprobs, scores))
    ]


def _grid(kv_cost_fp32: float, kv_cost_w4: float, n: int = 40) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    base = rng.normal(-1.0, 0.3, n)
    noise = lambda: rng.normal(0, 0.02, n)  # noqa: E731
    w4 = base - 0.5
    rows = (
        _rows("fp32", "fp16", base, [1.0] * n)
        + _rows("fp32", "q4_0", base - kv_cost_fp32 + noise(), [1.0] * n)
        + _rows("W4", "fp16", w4 + noise(), [1.0] * (n - 5) + [0.0] * 5)
        + _rows("W4", "q4_0", w4 - kv_cost_w4 + noise(), [1.0] * (n - 15) + [0.0] * 15)
    )
    return pd.DataFrame(rows)


def test_each_cell_is_paired_with_fp32_weights_and_the_fp16_cache_on_the_same_questions():
    t = weights_kv_table(_grid(0.1, 0.1)).set_index(["weights", "kv"])
    assert list(t.index) == [("fp32", "fp16"), ("fp32", "q4_0"), ("W4", "fp16"), ("W4", "q4_0")]
    assert (t["n"] == 40).all()
    assert t.loc[("fp32", "fp16"), "p"] == 1.0 and t.loc[("fp32", "fp16"), "logprob_diff"] == 0
    assert t.loc[("W4", "q4_0"), "accuracy"] == pytest.approx(25 / 40) and t.loc[("W4", "q4_0"), "losses"] == 15
    assert t.loc[("W4", "q4_0"), "p"] < 0.001
    assert t.loc[("W4", "fp16"), "logprob_diff"] == pytest.approx(-0.5, abs=0.02)


@pytest.mark.parametrize("w4_cost, verdict", [(0.6, "costs more"), (0.1, "inconclusive"), (-0.4, "costs less")])
def test_the_interaction_is_the_difference_in_differences_with_a_verdict_from_its_interval(w4_cost, verdict):
    t = interaction_table(_grid(0.1, w4_cost))
    assert len(t) == 1, "one row per (quantized weights, quantized cache): fp32 and fp16 are the references"
    r = t.iloc[0]
    assert (r["weights"], r["kv"], r["n"]) == ("W4", "q4_0", 40)
    assert r["kv_cost_on_fp32"] == pytest.approx(-0.1, abs=0.02) and r["kv_cost_on_weights"] == pytest.approx(
        -w4_cost, abs=0.02
    )
    assert r["logprob_did"] == pytest.approx(-(w4_cost - 0.1), abs=0.02)
    assert r["low"] <= r["logprob_did"] <= r["high"]
    assert r["accuracy_did"] == pytest.approx(-10 / 40)
    assert r["verdict"] == verdict


def test_a_cell_missing_its_references_gets_no_interaction_row():
    df = _grid(0.1, 0.2)
    assert interaction_table(df[~((df["weights"] == "W4") & (df["method"] == "fp16"))]).empty


def test_the_questions_are_the_batterys_when_its_lengths_hold_the_needle_lengths(smoke_with):
    cfg = smoke_with("weightquant", needle_lengths=[512])
    s = needle_battery(cfg)
    assert s.lengths == [512, 1024] and (s.contexts, s.needles) == (2, 2), "the battery's own settings: its questions"
    other = needle_battery(smoke_with("weightquant", needle_lengths=[256], needle={"contexts": 1, "needles": 3}))
    assert other.lengths == [256] and (other.contexts, other.needles) == (1, 3)
    with pytest.raises(ConfigError, match=r"weightquant.needle.contexts must be a whole number"):
        needle_battery(smoke_with("weightquant", needle={"contexts": 0, "needles": None}))


def test_fp32_cells_answer_the_batterys_questions_and_a_scheme_gets_its_own_rows(tmp_path, smoke_with, tiny):
    cfg = smoke_with("weightquant", needle_lengths=[512], kv_methods=["fp16", "q4_0"])
    battery = pd.DataFrame(read_rows(run_battery(cfg, tiny, tmp_path / "battery.jsonl", progress=False)))
    path = tmp_path / "weightquant_niah.jsonl"  # the run folder's file: the summary reads it
    fp32 = run_needles(cfg, tiny, QuantizedModel(Scheme("fp32")), ["q4_0"], path)
    assert set(fp32["method"]) == {"fp16", "q4_0"} and set(fp32["length"]) == {512} and len(fp32) == 2 * 4
    same = battery[(battery["length"] == 512) & battery["method"].isin(["fp16", "q4_0"])]
    keys = ["length", "depth", "trial", "method"]
    pd.testing.assert_series_equal(
        fp32.set_index(keys)["answer_logprob"].sort_index(),
        same.set_index(keys)["answer_logprob"].sort_index(),
        check_names=False,
    )
    w4 = Scheme("W4 RTN", w_bits=4, group=32)
    weights = tiny.model.model.layers[0].mlp.down_proj.weight.clone()
    rows = run_needles(cfg, tiny, QuantizedModel(w4, rtn_layers(tiny.model, w4)), ["q4_0"], path)
    assert len(rows) == 8 and (rows["weights"] == "W4 RTN").all()
    assert (tiny.model.model.layers[0].mlp.down_proj.weight == weights).all(), (
        "the scheme's weights leave with the block"
    )
    assert len(read_rows(path)) == 16
    again = run_needles(cfg, tiny, QuantizedModel(Scheme("fp32")), ["q4_0"], path)
    assert len(again) == 8 and len(read_rows(path)) == 16, "a rerun asks nothing again"
    text = "\n".join(_weights_parts(cfg, RunDir(cfg, tmp_path)))
    assert "**Weights x KV cache**" in text and "| W4 RTN" in text and "**Interaction**" in text


def test_the_weights_cells_ask_every_kv_method_whatever_the_batterys_method_lengths(smoke_with):
    """``battery.method_lengths`` narrows notebook 03's battery, not notebook 01's weights x KV cells."""
    cfg = smoke_with("battery", method_lengths={"q4_0": [1024]})
    assert cfg.battery.method_lengths and needle_battery(cfg).method_lengths == {}


def test_autoround_at_its_default_iterations_is_its_own_row_with_every_caches_cells_paired_with_fp32(
    tmp_path, smoke_with, tiny, monkeypatch
):
    """``make autoround-200``: a scheme apart from the chain's, its calibration keyed by its own iterations."""
    from niah.weightquant import schemes, study

    calls = []

    def calibrate(model, tokenizer, windows, bits, group, sym, iters, *args, **kwargs):
        calls.append(iters)  # AutoRound stood in by round-to-nearest: the test is about the plumbing
        return rtn_layers(model, Scheme("rtn", w_bits=bits, group=group, sym=sym)), {"iters": iters, "wall_s": 0.0}

    monkeypatch.setattr(study.autoround, "calibrate", calibrate)
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path / "cache"))  # no calibration cached from elsewhere
    cfg = smoke_with("weightquant", needle_lengths=[512], kv_methods=["fp16", "q4_0"])
    s = study.Study(cfg, tiny, tmp_path)
    assert "make autoround-200" in s.autoround_default()  # not measured yet: the sentence, not a table
    sch = schemes.autoround_default(cfg.weightquant)
    assert sch.iters == schemes.AUTOROUND_DEFAULT_ITERS and sch.group == cfg.weightquant.block_group
    s.evaluate([schemes.Scheme("fp32")], needle={"fp32": ["fp16", "q4_0"]})
    rows = s.autoround_default(run=True)
    assert list(rows["scheme"]) == [sch.name] and rows["iters"].iloc[0] == schemes.AUTOROUND_DEFAULT_ITERS
    assert calls == [schemes.AUTOROUND_DEFAULT_ITERS], "calibrated once, with its own iterations, not the config's"
    cells = pd.DataFrame(read_rows(RunDir(cfg, tmp_path).file("weightquant_needles")))
    assert set(cells[cells["weights"] == sch.name]["method"]) == {"fp16", "q4_0"}  # the interaction takes it
    assert len(s.autoround_default()) == 1 and len(s.autoround_default(run=True)) == 1 and len(calls) == 1
    text = "\n".join(_weights_parts(cfg, RunDir(cfg, tmp_path)))  # the summary's scheme table holds its row
    assert "**Weight schemes**" in text and f"| {sch.name}" in text and "source file's formats" not in text
