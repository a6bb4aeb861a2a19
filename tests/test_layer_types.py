"""Sliding-window and linear-attention layers in the packed cache: same logits as the model's own cache at fp16,
every stored layer type moves the logits when quantized, and bytes as the layout says."""

import pytest
import torch

from niah.experiments.protocol import ask, context_states, prefill
from niah.kv.cache import PackedCache, PackedLayer
from niah.kv.layout import FULL, LINEAR, SLIDING, CacheLayout, UnsupportedLayout
from niah.kv.methods.fp16 import CastStorage
from niah.kv.registry import KVMethod, get_method
from niah.kv.spec import CacheSpec

CONTEXT = list(range(1, 120))  # longer than the sliding window (16)
QUESTION, ANSWER = [40, 41, 42, 43, 44], [50, 51, 52]


FP32 = KVMethod("fp32", CastStorage("fp32", torch.float32), CastStorage("fp32", torch.float32))


def _plain_logsoftmax(model, ids, n):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -n:].float().log_softmax(-1)


def _ask(lm, cache):
    return ask(lm.model, lm.tokenizer, cache, QUESTION, ANSWER, 6)


def test_the_packed_cache_at_fp32_reads_what_the_models_own_cache_holds(hybrid):
    states = context_states(prefill(hybrid.model, CONTEXT, chunk=32))
    ans = _ask(hybrid, PackedCache.from_states(states, CacheSpec(FP32)))
    want = _plain_logsoftmax(hybrid.model, CONTEXT + QUESTION + ANSWER[:-1], len(ANSWER))
    assert ans.answer_logsoftmax == pytest.approx(want, abs=1e-4)


def test_decode_steps_past_the_window_match_a_plain_forward(hybrid):
    """Greedy steps over a sliding layer drop chunks older than the window; logits stay those of a plain forward."""
    states = context_states(prefill(hybrid.model, CONTEXT, chunk=32))
    cache = PackedCache.from_states(states, CacheSpec(FP32))
    ids = list(CONTEXT)
    with torch.no_grad():
        for token in [7] * 20:  # 20 one-token steps: more than the window of 16
            out = hybrid.model(torch.tensor([[token]]), cache=cache, use_cache=True)
            ids.append(token)
        want = _plain_logsoftmax(hybrid.model, ids, 1)
    assert out.logits[0, -1:].float().log_softmax(-1) == pytest.approx(want, abs=1e-4)
    for layer in cache.layers:
        if isinstance(layer, PackedLayer) and layer.is_sliding:
            assert layer.window - 1 <= layer.stored_tokens() < layer.window - 1 + 20


def test_a_quantized_method_changes_the_logits_through_every_layer_type_it_stores(hybrid):
    states = context_states(prefill(hybrid.model, CONTEXT, chunk=32))
    # a plain int: transformers >= 5.25 counts a linear layer's tokens in a tensor that later steps add to in place
    assert all(type(st.seen) is int and st.seen == len(CONTEXT) for st in states)
    ref = PackedCache.from_states(states, CacheSpec(get_method("fp16")))
    lossy = PackedCache.from_states(states, CacheSpec(get_method("q4_0")))
    kinds = {layer.layer_type for layer in lossy.layers if isinstance(layer, PackedLayer)}
    assert FULL in kinds and len(kinds) == (2 if hybrid.model.config.model_type == "gemma3_text" else 1)
    base = _ask(hybrid, ref.clone()).answer_logsoftmax
    for kind in kinds:
        mixed = ref.clone()
        mixed.layers = [
            q if isinstance(q, PackedLayer) and q.layer_type == kind else r
            for r, q in zip(ref.layers, lossy.clone().layers)
        ]
        assert not torch.equal(_ask(hybrid, mixed).answer_logsoftmax, base), (
            f"q4_0 on {kind} layers left the logits as fp16's"
        )


@pytest.mark.parametrize("method", ["fp16", "q8_0", "q4_0", "turbo3"])
def test_stored_bytes_per_layer_type_are_the_layouts(hybrid, method):
    layout = CacheLayout.from_config(hybrid.model.config)
    states = context_states(prefill(hybrid.model, CONTEXT, chunk=32))
    m = get_method(method)
    stored = PackedCache.from_states(states, CacheSpec(m)).nbytes()
    want = layout.kv_bytes(len(CONTEXT), m.analytical_bits(layout.head_dim))
    for kind in (FULL, SLIDING):
        assert stored[kind] == pytest.approx(want.get(kind, 0), rel=0.02)
    assert stored["total"] == pytest.approx(want["total"], rel=0.02)
    assert stored["linear_state"] == layout.linear_state_values() * 4  # fp32 states, not in the KV total


def test_fp16_sliding_layers_keep_full_precision_there_only(hybrid):
    if hybrid.model.config.model_type != "gemma3_text":
        pytest.skip("no sliding layers")
    states = context_states(prefill(hybrid.model, CONTEXT, chunk=32))
    both, full_only = (
        PackedCache.from_states(states, CacheSpec(get_method("q4_0"), sliding=s)) for s in ("quantize", "fp16")
    )
    fp16 = PackedCache.from_states(states, CacheSpec(get_method("fp16"))).nbytes()
    assert full_only.nbytes()[SLIDING] == fp16[SLIDING] > both.nbytes()[SLIDING]
    assert full_only.nbytes()[FULL] == both.nbytes()[FULL] < fp16[FULL]
    with pytest.raises(ValueError, match="sliding-layer storage"):
        PackedCache.from_states(states, CacheSpec(get_method("q4_0"), sliding="bf16"))


def test_the_layout_of_the_seeds_qwen3_5_moe():
    """Qwen3.5-35B-A3B: 10 of 40 layers keep KV (2 heads of 256); the other 30 a fixed linear-attention state."""
    from niah.kv.layout import qwen3_5_35b_a3b_config

    layout = CacheLayout.from_config(qwen3_5_35b_a3b_config())
    assert (layout.count(FULL), layout.count(LINEAR), layout.kv_heads, layout.head_dim) == (10, 30, 2, 256)
    assert layout.kv_bytes(16384, 16)["total"] == 10 * 16384 * 2 * 2 * 256 * 2


def test_unsupported_layouts_stop_with_one_sentence(hybrid):
    if hybrid.model.config.model_type == "gemma3_text":
        with pytest.raises(UnsupportedLayout, match="sliding window \\(16 tokens\\) is longer than a 8-token context"):
            CacheLayout.from_config(hybrid.model.config).check_context(8, "tiny")
    config = type(hybrid.model.config)(**{**hybrid.model.config.to_dict(), "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(UnsupportedLayout, match="chunked_attention"):
        CacheLayout.from_config(config)
