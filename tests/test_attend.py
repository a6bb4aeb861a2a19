"""The fused decode step reads the codes and must give the attention of the dequantized cache."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import niah.kv.attend as attend
from niah.experiments.protocol import context_states, prefill
from niah.kv.cache import FusedDecodeLayer, PackedCache, PackedLayer, fused_decoding
from niah.kv.registry import get_method
from niah.kv.spec import CacheSpec

FUSED = [
    "q8_0",
    "q4_0",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp4_e2m1",
    "kivi2",
    "sliding_window_asym3",
    "turbo2",
    "turbo3",
    "turbo4",
    "turbo2.5",
    "turbo3_prod",
]  # read by the row kernels
PLAIN = ["fp16", "bf16"]  # chunk by chunk, dequantized


def _layer(method: str, tokens: int = 200, kv_heads: int = 2, head_dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 1, kv_heads, tokens + 1, head_dim, generator=g)
    k[..., :3] *= 6.0  # a few large channels, as real keys have
    fused = FusedDecodeLayer(get_method(method), 3, keep_dequantized=False)
    plain = PackedLayer(get_method(method), 3, keep_dequantized=False)
    for layer in (fused, plain):
        layer.update(k[..., :tokens, :], v[..., :tokens, :])
    assert fused.update(k[..., tokens:, :], v[..., tokens:, :]) == (fused, fused)
    keys, values = plain.update(k[..., tokens:, :], v[..., tokens:, :])
    return fused, keys, values


@pytest.mark.parametrize("method", FUSED + PLAIN)
def test_fused_step_equals_attention_over_the_dequantized_cache(method):
    layer, keys, values = _layer(method)
    q = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(1))
    want = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
    got = attend.decode_attention(q, layer, 64**-0.5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_compile_failure_runs_the_kernel_eagerly_with_one_warning(monkeypatch):
    monkeypatch.setattr(attend, "_compile_error", None)

    def broken(fn):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(attend, "_compiled", broken)
    x = torch.arange(6.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(attend.fused(torch.square, x), x * x)
        assert torch.equal(attend.fused(torch.square, x), x * x)  # no second compile attempt, no second warning
    assert [str(w.message) for w in caught] == [
        "torch.compile failed (RuntimeError: no C++ compiler); fused KV kernels run eagerly (slower)"
    ]


def test_a_bug_in_a_kernel_is_raised_not_hidden_by_the_fallback(monkeypatch):
    monkeypatch.setattr(attend, "_compile_error", None)

    def wrong_shapes(a, b):
        return a @ b

    with pytest.raises(RuntimeError):
        attend.fused(wrong_shapes, torch.ones(2, 4), torch.ones(3, 5))
    assert attend._compile_error is None


def test_decoding_a_real_model_through_the_fused_path_gives_the_same_tokens(tiny):
    ids = list(range(40, 240))
    kv = context_states(prefill(tiny.model, ids, chunk=128))
    runs = {}
    for fused in (False, True):
        cache = PackedCache.from_states(kv, CacheSpec(get_method("q8_0"), keep_dequantized=False, fused_decode=fused))
        with fused_decoding(tiny.model):
            logits = [
                tiny.model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1] for t in (5, 6, 7)
            ]
        runs[fused] = torch.stack(logits)
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-4, atol=1e-4)
    assert tiny.model.config._attn_implementation != "niah_packed", "fused_decoding must restore the model"
