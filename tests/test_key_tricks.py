"""The key tricks of issue 41 as modifiers: per-channel key statistics (``+centred``, ``+scaled``, ``+static``), raw
sink and recent tokens (``+sink<N>``, ``+recent<N>``), layer selection (``+layers=``) and the preset variants."""

import pytest
import torch

from niah.experiments import keystats
from niah.experiments.protocol import context_states, prefill
from niah.experiments.specs import cache_spec
from niah.kv.cache import PackedCache, PackedLayer
from niah.kv.methods.affine import MEAN, SCALE, KeyAffine
from niah.kv.methods.sink import SINK
from niah.kv.registry import LayerPolicy, get_method, with_modifier
from niah.kv.spec import CacheSpec


def _keys(seed=0, tokens=300, heads=2, dim=64):
    """Keys as models make them: a large per-channel offset and channels of very different size."""
    g = torch.Generator().manual_seed(seed)
    offset = 4 * torch.randn(1, heads, 1, dim, generator=g)
    size = torch.exp(1.5 * torch.randn(1, heads, 1, dim, generator=g))
    return offset + size * torch.randn(1, heads, tokens, dim, generator=g)


def _error(name, x):
    """Each channel's mean square error relative to its variance, averaged: what a small channel keeps."""
    q = get_method(name).key
    return ((q.dequantize(q.quantize(x)) - x).square().mean(-2) / x.var(-2)).mean().item()


@pytest.mark.parametrize("inner", ["turbo3", "q4_0", "turboquant_k3v4_nc"])
def test_each_statistic_taken_out_lowers_the_key_error(inner):
    x = _keys()
    err = {m: _error(f"{inner}{m}", x) for m in ("", "+centred", "+centred+scaled")}
    assert err["+centred+scaled"] < err["+centred"] < err[""], err


@pytest.mark.parametrize("name", ["turbo3+centred+scaled", "q4_0+scaled", "turboquant_k3v4_nc+centred+scaled"])
def test_affine_keys_store_their_statistics_once_and_read_as_dequantized(name):
    q, x = get_method(name).key, _keys(1)
    p = q.quantize(x)
    inner = get_method(name.split("+")[0]).key.quantize(x).nbytes()
    stats = [k for k in (MEAN, SCALE) if k in p.tensors]
    assert p.nbytes() == inner + len(stats) * 2 * 64 * 2  # fp16 (1, H, 1, D) each
    deq = q.dequantize(p).float()
    qv, w = torch.randn(1, 2, 3, 64), torch.softmax(torch.randn(1, 2, 3, 300), -1)
    torch.testing.assert_close(q.scores(p, qv), qv @ deq.transpose(-1, -2), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(q.weighted_sum(p, w), w @ deq, atol=2e-3, rtol=1e-3)
    later = q.quantize_after(x[..., :5, :], p)
    assert all(torch.equal(later.tensors[k], p.tensors[k]) for k in stats)  # the first block's statistics


def test_a_static_method_needs_its_statistics():
    with pytest.raises(ValueError, match="per-model key statistics"):
        get_method("q4_0+centred+static").key.for_layer(0)


def test_static_statistics_are_calibrated_once_per_model_and_kept_on_disk(tiny, smoke_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path))
    monkeypatch.setattr(keystats, "_MEMO", {})
    spec = cache_spec(smoke_cfg, "q4_0+centred+scaled+static", tiny)
    saved = list((tmp_path / "keystats").glob("*.safetensors"))
    assert len(saved) == 1
    stats = spec.method.key.stats
    assert set(stats.mean) == {0, 1} and stats.mean[0].shape == (2, 32)
    monkeypatch.setattr(keystats, "_MEMO", {})
    again = cache_spec(smoke_cfg, "q4_0+centred+scaled+static", tiny).method.key.stats
    assert all(torch.equal(again.meansq[i], stats.meansq[i]) for i in stats.meansq)  # read back from the file
    ids = tiny.tokenizer.encode("def f(x):\n    return x + 1\n" * 20)
    kv = context_states(prefill(tiny.model, ids))
    layer = PackedCache.from_states(kv, spec).layers[0]
    mu, s = stats.of(0, centre=True)
    assert torch.equal(layer.chunks[0][0].tensors[MEAN], mu) and torch.equal(layer.chunks[0][0].tensors[SCALE], s)


def test_sink_tokens_are_kept_at_fp16_and_the_rest_coded_as_before():
    q, x = get_method("turbo3+sink4").key, _keys(2)
    p = q.quantize(x)
    deq = q.dequantize(p)
    torch.testing.assert_close(deq[..., :4, :], x[..., :4, :].half().float())
    plain = get_method("turbo3").key
    torch.testing.assert_close(deq[..., 4:, :], plain.dequantize(plain.quantize(x[..., 4:, :])))
    assert p.nbytes() == plain.quantize(x[..., 4:, :]).nbytes() + 4 * 2 * 64 * 2
    qv, w = torch.randn(1, 2, 3, 64), torch.softmax(torch.randn(1, 2, 3, 300), -1)
    torch.testing.assert_close(q.scores(p, qv), qv @ deq.float().transpose(-1, -2), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(q.weighted_sum(p, w), w @ deq.float(), atol=2e-3, rtol=1e-3)
    assert SINK not in q.quantize_after(x[..., :3, :], p).tensors


def test_recent_tokens_stay_raw_in_the_residual_window():
    m = get_method("q4_0+recent64")
    layer = PackedLayer(m, 0)
    x = _keys(4, tokens=200)
    k, v = layer.update(x, x)
    assert m.residual == 64 and layer.res_k.shape[-2] == 64
    torch.testing.assert_close(k[..., -64:, :], x[..., -64:, :])
    assert not torch.allclose(k[..., :-64, :], x[..., :-64, :])
    assert layer.nbytes()[1] == 2 * 64 * 2 * 64 * 4  # keys and values of 64 tokens, fp32 here


def test_layer_selection_and_the_grammar():
    assert get_method("turboquant_k3v4_nc+layers=11,5").layers == LayerPolicy(only=(5, 11))
    assert get_method("q8_0+layers=1").layers.stores(1, "full_attention", 18, False)
    assert not get_method("q8_0+layers=1").layers.stores(0, "full_attention", 18, False)
    same = get_method("q4_0+scaled+sink2+centred").key, get_method("q4_0+centred+sink2+scaled").key
    assert same[0].name == same[1].name == "q4_0+centred+scaled+sink2"
    assert isinstance(same[0].inner, KeyAffine)  # the sink outside: its outliers stay out of the statistics
    assert with_modifier("q4_0+layers=5@engine", "full") is None
    assert with_modifier("q4_0+sink4", "keys") == "q4_0+sink4+keys"
    for bad in ("q4_0+static", "q4_0+sink", "q4_0+layers=", "q4_0+sink4+sink2", "q4_0+layers=5+all_layers"):
        with pytest.raises(ValueError, match="q4_0"):
            get_method(bad)


@pytest.mark.parametrize("name, bits", [("turboquant_k3v8_nc", (3, 8)), ("turboquant_k2v4_nc", (2, 4))])
def test_preset_variants_code_at_their_bits(name, bits):
    m = get_method(name)
    x = _keys(5, dim=256)
    assert m.key.quantize(x).tensors["slot"].shape[-1] == 256 * bits[0] // 8 + 2
    assert m.value.quantize(x).tensors["slot"].shape[-1] == 256 * bits[1] // 8 + 4
    assert m.layers == get_method("turboquant_k3v4_nc").layers
    assert CacheSpec.resolve(name).method.value.bits == bits[1]


def test_coded_bits_measures_each_modifier_from_the_stored_tensors():
    from niah.report.tables import coded_bits

    bits = {
        m: coded_bits(m, 1, 256, 1024)
        for m in ("fp16", "q8_0", "q8_0+centred", "q8_0+centred+static", "q8_0+sink4", "q8_0+recent128")
    }
    assert bits["fp16"] == 16 and bits["q8_0"] == pytest.approx(8.5)  # 32 int8 codes and one fp16 scale
    assert bits["q8_0+centred"] == pytest.approx(8.5 + 16 / 1024 / 2)  # one fp16 mean per channel, keys only
    assert bits["q8_0+centred+static"] == bits["q8_0+centred"]
    assert bits["q8_0+sink4"] == pytest.approx(8.5 + 4 * (16 - 8.5) / 1024, rel=1e-3)
    assert bits["q8_0+recent128"] == pytest.approx((896 * 8.5 + 128 * 16) / 1024, rel=1e-3)


def test_ablation_table_pairs_the_longest_length_against_the_reference_cheapest_first():
    from niah.report.tables import ablation_table

    def rows(method, scores, length=2048):
        return [
            {
                "method": method,
                "status": "ok",
                "prompt_style": "plain",
                "length": length,
                "depth": i,
                "trial": 0,
                "score": float(s),
                "answer_logprob": -float(1 - s),
            }
            for i, s in enumerate(scores)
        ]

    import pandas as pd

    df = pd.DataFrame(
        rows("fp16", [1] * 8)
        + rows("fp16", [1] * 8, 1024)
        + rows("q4_0", [0] * 8, 1024)
        + rows("q8_0", [1] * 7 + [0])
        + rows("q4_0+centred", [1] * 4 + [0] * 4)
    )
    t = ablation_table(df, "fp16", 2048, 1, 64)
    assert list(t["method"]) == ["q4_0+centred", "q8_0"]  # 4.5+ bits before 8.5; no fp16 row, no 1024 row
    assert list(t["losses"]) == [4, 1] and t["coded_bits"].is_monotonic_increasing
    assert ablation_table(df, "fp16", 4096, 1, 64).empty  # no length asked: an empty table, no error


def test_key_drift_is_zero_on_the_calibration_window_itself_and_grows_away_from_it(
    tiny, smoke_cfg, tmp_path, monkeypatch
):
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path))
    monkeypatch.setattr(keystats, "_MEMO", {})
    monkeypatch.setattr(keystats, "WINDOWS", 1)  # statistics of one window: its own keys' mean and spread
    ids = keystats._windows(smoke_cfg, tiny)[0].tolist()
    n = len(ids)
    drift = keystats.key_drift(smoke_cfg, tiny, ids, [n, n // 2], tokens=n)
    assert len(drift[n]) == 2 and max(drift[n]) < 1e-3  # the calibration's own keys
    assert min(drift[n // 2]) > 10 * max(drift[n])  # the first half's mean is not the whole window's


def test_the_ablation_figure_draws_an_interval_that_rounding_puts_inside_its_point():
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from niah.report.plots import ablation

    row = {"method": "q8_0", "coded_bits": 8.5, "accuracy": 1.0, "ci_low": 0.93, "ci_high": 1.0 - 1e-16, "p": 1.0}
    assert ablation(pd.DataFrame([row]), 1.0, 1024).axes[0].get_title()
