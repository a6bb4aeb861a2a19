import contextlib

import pytest

from niah.experiments.sweep import run_sweep
from niah.report.fits import polyfit
from niah.results import read_rows
from niah.rundir import TABLES

KEY = TABLES["sweep"].key


def test_sweep_rows_bytes_timings_and_traces(smoke_with, tiny, tmp_path):
    cfg = smoke_with("sweep")
    rows = read_rows(run_sweep(cfg, tiny, tmp_path / "s.jsonl", progress=False))
    assert len(rows) == len(cfg.sweep.lengths) * len(cfg.sweep.methods)
    assert {r["status"] for r in rows} == {"ok"}
    fp16 = sorted((r for r in rows if r["method"] == "fp16"), key=lambda r: r["length"])
    fit = polyfit([r["length"] for r in fp16], [r["kv_bytes"] for r in fp16], 1)
    assert fit.r2 == pytest.approx(1.0) and fit.coef[0] == pytest.approx(
        2 * 2 * 2 * 32 * 2
    )  # K+V, layers, heads, dim, fp16
    for r in rows:
        assert r["kv_bytes"] == pytest.approx(r["kv_bytes_analytical"], rel=0.01)
        assert r["decode_steps"] == 32 and 0 < r["tpot_median_s"] <= r["tpot_p90_s"]
        assert r["tpot_vs_ref"] == 1.0 if r["method"] == "fp16" else r["tpot_vs_ref"] > 0
        assert r["ttft_s"] >= r["prefill_s"] > 0
        assert len(r["trace_t"]) == len(r["trace_bytes"]) >= 1
    assert {r["probe"] for r in rows} == {True, False}  # 1 token cannot hold the needle; 512 can


def test_memory_budget_is_an_oom_status_and_the_sweep_goes_on(smoke_with, tiny, tmp_path):
    cfg = smoke_with("sweep", lengths=[64, 512, 256], memory_budget_gib=200 * 2 * 2 * 2 * 32 * 4 / 2**30)
    rows = {
        (r["method"], r["length"]): r for r in read_rows(run_sweep(cfg, tiny, tmp_path / "s.jsonl", progress=False))
    }
    assert rows[("fp16", 64)]["status"] == "ok"
    assert rows[("fp16", 256)]["status"] == "oom" and "budget" in rows[("fp16", 256)]["reason"]
    assert rows[("turbo3", 512)]["status"] == "oom"


def test_a_killed_sweep_resumes_without_duplicates(smoke_with, tiny, tmp_path, killed_after):
    cfg = smoke_with("sweep")
    path = tmp_path / "r.jsonl"
    kill = killed_after(3)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, tiny, path, progress=False)
    kill.revive()
    assert len(read_rows(path)) == 3
    rows = read_rows(run_sweep(cfg, tiny, path, progress=False))
    keys = [tuple(r[k] for k in KEY) for r in rows]
    assert len(keys) == len(set(keys)) == len(cfg.sweep.lengths) * len(cfg.sweep.methods)


def test_unknown_sweep_setting_is_named(smoke_with, tiny, tmp_path):
    with pytest.raises(ValueError, match="unknown sweep setting"):
        run_sweep(smoke_with("sweep", step=3), tiny, tmp_path / "s.jsonl", progress=False)


def test_decode_timing_keeps_no_autograd_graph(tiny):
    """Decoding with grad enabled chained every step's dequantized cache into one graph (GBs at 4K on SmolLM2)."""
    from niah.experiments.protocol import context_states, prefill
    from niah.experiments.sweep import _greedy
    from niah.kv.cache import PackedCache
    from niah.kv.registry import get_method
    from niah.kv.spec import CacheSpec

    kv = context_states(prefill(tiny.model, list(range(64))))
    cache = PackedCache.from_states(kv, CacheSpec(get_method("kivi2"), keep_dequantized=False))
    _greedy(tiny.model, cache, 1, 4)
    layer = cache.layers[0]
    assert not layer.res_k.requires_grad
    assert not any(t.requires_grad for k, v in layer.chunks for t in (*k.tensors.values(), *v.tensors.values()))


def test_paired_tpot_ratio_ignores_a_machine_that_slows_down(monkeypatch):
    """Each method's steps cost its own time, times a slowdown that triples halfway through: the ratios to the
    reference compare steps of the same round, so they come out as the per-step costs' ratios."""
    import niah.experiments.sweep as sweep

    cost = {"fp16": 1.0, "q8_0": 0.8, "turbo3": 1.3}
    calls = []

    def step(model, cache, token):
        calls.append(cache)
        return token + 1, cost[cache] * (1.0 if len(calls) <= 3 * 8 else 3.0)

    class Cache(str):  # a method's cache is its name here; the prompt it ends is none
        def end_prompt(self):
            pass

    monkeypatch.setattr(sweep.PackedCache, "from_states", staticmethod(lambda kv, method, **kw: Cache(method)))
    monkeypatch.setattr(sweep, "_decode_step", step)
    monkeypatch.setattr(sweep, "fused_decoding", lambda model: contextlib.nullcontext())
    lm = type("LM", (), {"model": None})()
    out = sweep._paired_tpot(lm, None, {m: m for m in cost}, {m: 0 for m in cost}, 16, "fp16")
    assert {m: r["tpot_vs_ref"] for m, r in out.items()} == pytest.approx(cost)
    assert out["q8_0"]["tpot_median_s"] == pytest.approx(0.8 * 2)  # the median of 8 fast and 8 slow steps
    assert calls[:3] == ["fp16", "q8_0", "turbo3"] and calls[3:6] == ["q8_0", "turbo3", "fp16"]  # order rotates


def test_engine_read_methods_run_through_the_sweep(smoke_with, tiny, tmp_path):
    """The sweep stores a ``name@engine`` method with the config's prompt chunk (it gave none, and failed at its
    first length), from a one-token context up."""
    cfg = smoke_with("sweep", lengths=[1, 256], methods=["q8_0@engine"])
    rows = read_rows(run_sweep(cfg, tiny, tmp_path / "s.jsonl", progress=False))
    assert sorted((r["method"], r["length"], r["status"]) for r in rows) == [
        (m, L, "ok") for m in ("fp16", "q8_0@engine") for L in (1, 256)
    ]


def test_the_sweep_hashes_the_engine_chunk_only_when_it_asks_an_engine_method(smoke_cfg, smoke_with):
    """``niah.engine_chunk`` is hashed by the sweep table where the sweep reads a method as vLLM does (its rows depend
    on it), and nowhere else: the sweep rows of every config without such a method keep their hash."""
    from niah.rundir import settings_hash

    engine = smoke_with("sweep", methods=["fp16", "q8_0@engine"])
    assert settings_hash(engine, "sweep") != settings_hash(engine.updated("niah", engine_chunk=8192), "sweep")
    assert settings_hash(smoke_cfg, "sweep") == settings_hash(smoke_cfg.updated("niah", engine_chunk=8192), "sweep")


def test_paired_decode_steps_of_an_engine_method_read_the_stored_cache(tiny, monkeypatch):
    """TPOT times vLLM's decode kernel, which reads the stored form: each paired decode step of ``q4_0@engine`` gives
    the logits of ``q4_0`` read strict (reading the raw context instead, it gave other logits)."""
    import torch

    import niah.experiments.sweep as sweep
    from niah.experiments.protocol import context_states, prefill
    from niah.kv.spec import CacheSpec

    logits, real = {}, sweep._decode_step

    def step(model, cache, token):  # the step's logits, by method
        hook = model.register_forward_hook(
            lambda m, i, out: logits.setdefault(cache.spec.method.name, []).append(out.logits)
        )
        try:
            return real(model, cache, token)
        finally:
            hook.remove()

    monkeypatch.setattr(sweep, "_decode_step", step)
    kv = context_states(prefill(tiny.model, list(range(40, 104)), chunk=64))
    specs = {
        n: CacheSpec.resolve(n, 4096, fused_decode=True, keep_dequantized=False)
        for n in ("fp16", "q4_0", "q4_0@engine")
    }
    sweep._paired_tpot(tiny, kv, specs, {n: 7 for n in specs}, 4, "fp16")
    assert len(logits["q4_0@engine"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(logits["q4_0"], logits["q4_0@engine"]))


def test_key_trick_methods_run_through_the_sweep(smoke_with, tiny, tmp_path):
    """Issue 41's composed caches (key statistics per prompt or calibrated once, every layer coded) decode through
    the sweep's fused path."""
    methods = ["turboquant_3bit_nc+centred+scaled", "turboquant_3bit_nc+centred+scaled+all_layers+static"]
    cfg = smoke_with("sweep", lengths=[64, 256], methods=["fp16", *methods])
    rows = read_rows(run_sweep(cfg, tiny, tmp_path / "s.jsonl", progress=False))
    assert {r["status"] for r in rows} == {"ok"} and len(rows) == 6
    bits = {r["method"]: r["kv_bytes"] for r in rows if r["length"] == 256}
    assert bits[methods[1]] < bits[methods[0]] == bits["fp16"]  # the tiny model's 2 layers are vLLM's boundary layers


def test_the_sweep_table_shows_its_three_longest_lengths_by_default():
    """The summary's sweep table: quick's sweep (1, 1K, 2K tokens) showed no row when the lengths were fixed at
    4K-16K."""
    import pandas as pd

    from niah.report.analysis import at_lengths

    sweep = pd.DataFrame(
        [{"method": m, "length": L, "status": "ok", "kv_bytes": L * (2 if m == "fp16" else 1)}
         for m in ("fp16", "q8_0") for L in (1, 1024, 2048)]
    )  # fmt: skip
    table = at_lengths(sweep)
    assert sorted(set(table["length"])) == [1024, 2048]
    assert set(table.loc[table["method"] == "q8_0", "bytes_vs_ref"]) == {0.5}
