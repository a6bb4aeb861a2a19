"""Every registered KV method, stored in the packed cache and read by the question pass of a tiny model; the layer
classes a cache spec picks."""

import random

import pytest
import torch

from niah.data.haystack import haystack_text, tokenize_haystack
from niah.data.needles import NeedleSpec, make_trial
from niah.data.prompts import build_cell
from niah.experiments.protocol import ask, compare_logits, context_states, prefill, read_prompt
from niah.kv import cache as cache_module
from niah.kv.base import concat_tokens
from niah.kv.cache import (
    EngineLayer,
    FusedDecodeLayer,
    FusedEngineLayer,
    LayerState,
    PackedCache,
    PackedLayer,
    fused_decoding,
)
from niah.kv.layout import FULL, SLIDING
from niah.kv.registry import LayerPolicy, available, get_method
from niah.kv.spec import CacheSpec

# each codec on every layer of the 2-layer model (a layer policy such as vLLM's would keep both at fp16), and
# keys centred and scaled
METHODS = [m if get_method(m).layers == LayerPolicy() else f"{m}+all_layers" for m in available() if m != "fp16"]
METHODS += [
    "q4_0+centred",
    "turboquant_k3v4_nc+centred+all_layers",
    "q4_0+scaled",
    "turboquant_k3v4_nc+centred+scaled+all_layers",
]
# raw sink tokens in the first block only: a later block must read as its tokens stored one by one (their bytes,
# which depend on the context's length, are tested in test_key_tricks)
SINKS = ["q4_0+sink4", "turboquant_k3v4_nc+centred+scaled+sink4+all_layers"]


@pytest.fixture(scope="module")
def setup(tiny):
    hay = tokenize_haystack(haystack_text("pydoc"), tiny.tokenizer, 1400)
    cell = build_cell(tiny.tokenizer, hay, 1024, 0.5, make_trial(NeedleSpec(), random.Random(5)), "completion")
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=256))
    fp16 = PackedCache.from_states(kv, CacheSpec(get_method("fp16")))
    return tiny, cell, kv, ask(tiny.model, tiny.tokenizer, fp16, cell.question_ids, cell.answer_ids, 4)


def _ask(setup, method):
    tiny, cell, kv, _ = setup
    cache = PackedCache.from_states(kv, CacheSpec(get_method(method)))
    return ask(tiny.model, tiny.tokenizer, cache, cell.question_ids, cell.answer_ids, 4)


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_method_is_not_the_fp16_cache(setup, method):
    ans = _ask(setup, method)
    assert not torch.equal(ans.answer_logsoftmax, setup[3].answer_logsoftmax), f"{method} returned fp16's logits"


@pytest.mark.parametrize("method", METHODS)
def test_stored_bytes_match_the_format(setup, method):
    tiny, cell, kv, _ = setup
    m = get_method(method)
    cache = PackedCache.from_states(kv, CacheSpec(m))
    layer = cache.layers[0]
    packed_tokens = layer.get_seq_length() - layer.res_k.shape[-2]
    values = 2 * kv[0].keys.shape[1] * kv[0].keys.shape[3] * packed_tokens
    measured = 8 * layer.nbytes()[0] / values
    assert measured == pytest.approx(m.analytical_bits(tiny.head_dim), rel=0.01)
    assert layer.res_k.shape[-2] <= m.residual + m.token_group  # only the residual window stays in full precision
    full = sum(s.keys.numel() * 4 * 2 for s in kv)
    assert cache.nbytes()["total"] < full or method in ("bf16",)


def test_kl_against_fp16_is_ordered_by_precision(setup):
    kl = {
        m: compare_logits(setup[3].answer_logsoftmax, _ask(setup, m).answer_logsoftmax)[0]
        for m in ("q8_0", "q4_0", "turbo2")
    }
    assert kl["q8_0"] < kl["q4_0"] < kl["turbo2"], kl


def test_unsupported_head_dim_names_the_method_and_the_choices():
    with pytest.raises(ValueError, match="q8_0"):
        get_method("q8_0").check_head_dim(48)


@pytest.mark.parametrize("method", ["q8_0", "q4_0", "turbo3", "turbo3_prod", "fp8_e5m2", "turbo2.5"])
@pytest.mark.parametrize("keep", [True, False])
def test_decode_steps_merge_chunks_without_changing_what_is_read(method, keep):
    """One-token decode chunks of tokenwise formats merge into few chunks (here, into the short prefill's); every
    read equals that of a cache that keeps them apart, with or without the dequantized memo."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 1, 2, 140, 64, generator=g)
    layer = PackedLayer(get_method(method), 1, keep_dequantized=keep)
    apart = PackedLayer(get_method(method), 1, keep_dequantized=False)
    apart.kq.tokenwise = apart.vq.tokenwise = False
    for cache in (layer, apart):
        cache.update(k[..., :100, :], v[..., :100, :])
    for t in range(100, 140):
        want = apart.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        got = layer.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        torch.testing.assert_close(got, want)  # float rounding only: a merged chunk is dequantized in one matmul
    assert len(apart.chunks) == 41
    assert len(layer.chunks) == 1, f"{len(layer.chunks)} chunks after 40 decode steps"
    for kind in (0, 1):  # the stored codes are the same bits, and a shared parameter is the prefill's
        first = layer.chunks[0][kind]
        for name, tensor in first.tensors.items():
            if name in first.meta.get("shared", ()):
                assert all(torch.equal(c[kind].tensors[name], tensor) for c in apart.chunks), name
                continue
            joined = [
                torch.cat([c[kind].tensors[name] for c in chunks], dim=2) for chunks in (layer.chunks, apart.chunks)
            ]
            assert torch.equal(*joined), name


def test_blocks_coded_with_different_shared_parameters_do_not_join():
    q = get_method("fp8_e4m3").key
    a, b = q.quantize(torch.randn(1, 2, 5, 32)), q.quantize(torch.randn(1, 2, 3, 32))
    with pytest.raises(ValueError, match="scales"):
        concat_tokens(a, b)
    joined = concat_tokens(a, q.quantize_after(torch.randn(1, 2, 3, 32), a))
    assert joined.shape == (1, 2, 8, 32) and joined.tensors["scales"].shape == (1, 2)


@pytest.mark.parametrize("method", METHODS + SINKS)
def test_a_block_of_new_tokens_reads_as_the_same_tokens_stored_one_by_one(method):
    x = torch.randn(1, 2, 240, 64, generator=torch.Generator().manual_seed(4))
    block, steps = (PackedLayer(get_method(method), 0) for _ in range(2))
    for layer in (block, steps):
        layer.update(x[..., :190, :], x[..., :190, :])
    want = block.update(x[..., 190:, :], x[..., 190:, :])
    for t in range(190, 240):
        got = steps.update(x[..., t : t + 1, :], x[..., t : t + 1, :])
    torch.testing.assert_close(got, want)


def test_long_decodes_keep_few_chunks(monkeypatch):
    """Past MERGE_BELOW tokens the chunks of a decode merge as a binary counter: O(log n) of them."""
    monkeypatch.setattr(cache_module, "MERGE_BELOW", 4)
    layer = PackedLayer(get_method("q8_0"), 0, keep_dequantized=False)
    x = torch.randn(1, 1, 300, 32)
    layer.update(x[..., :200, :], x[..., :200, :])
    for t in range(200, 300):
        layer.update(x[..., t : t + 1, :], x[..., t : t + 1, :])
    sizes = [k.shape[-2] for k, _ in layer.chunks]
    assert sizes[0] == 200 and sum(sizes) == 300 and len(sizes) <= 1 + 7, sizes


@pytest.mark.parametrize(
    ("name", "fused", "full", "sliding"),
    [
        ("q8_0", False, PackedLayer, PackedLayer),
        ("q8_0", True, FusedDecodeLayer, PackedLayer),
        ("q8_0@engine", False, EngineLayer, EngineLayer),
        ("q8_0@engine", True, FusedEngineLayer, EngineLayer),
    ],
)
def test_the_spec_picks_each_layer_class_once(name, fused, full, sliding):
    """Read mode and decode path choose the class; a sliding-window layer is never fused (its reads are cut)."""
    x = torch.randn(1, 1, 8, 32)
    states = [LayerState(FULL, 8, x, x), LayerState(SLIDING, 8, x, x, window=16)]
    cache = PackedCache.from_states(states, CacheSpec.resolve(name, 64, fused_decode=fused))
    assert [type(layer) for layer in cache.layers] == [full, sliding]
    assert [type(layer) for layer in cache.clone().layers] == [full, sliding]
    cache.end_prompt()  # later one-token passes are decode steps: fused, the layer itself; else tensors
    assert (cache.layers[0].update(x[..., :1, :], x[..., :1, :])[0] is cache.layers[0]) == fused


def test_a_spec_resolves_the_prompt_chunk_for_engine_methods_only():
    assert CacheSpec.resolve("q8_0", 64).engine_chunk is None
    assert CacheSpec.resolve("q8_0@engine", 64).engine_chunk == 64
    with pytest.raises(ValueError, match="niah.engine_chunk"):
        CacheSpec.resolve("q8_0@engine")
    with pytest.raises(ValueError, match="takes no prompt chunk"):
        CacheSpec(get_method("q8_0"), engine_chunk=64)


def test_engine_reads_with_fused_decode_read_a_one_token_context_raw(tiny):
    """The sweep's first step: a one-token context, stored by a one-token pass, is still the prompt's first chunk,
    so the question reads it raw (as the model's own cache), the fused decode path or not."""
    ids = list(range(40, 60))
    want = tiny.model(input_ids=torch.tensor([ids])).logits[0, -1]
    states = context_states(prefill(tiny.model, ids[:1]))
    for fused in (False, True):
        spec = CacheSpec.resolve("turbo2@engine", 4096, keep_dequantized=False, fused_decode=fused)
        with fused_decoding(tiny.model):
            got = read_prompt(tiny.model, PackedCache.from_states(states, spec), ids[1:]).logits[0, -1]
        assert torch.allclose(got, want, atol=1e-4), fused
