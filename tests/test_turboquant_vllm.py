"""vLLM's TurboQuant presets (store arithmetic, bytes, round trips), layer policies, engine reads and key centring."""

import math

import pytest
import torch

from niah.experiments.protocol import ask, context_states, prefill, read_prompt
from niah.experiments.specs import check_engine_reads
from niah.kv.cache import CONTINUATION_DECODE_THRESHOLD, LayerState, PackedCache, PackedLayer
from niah.kv.layout import FULL, LINEAR, SLIDING
from niah.kv.methods.turboquant_vllm import (
    PRESETS,
    gaussian_codebook,
    key_packed_size,
    sylvester_hadamard,
    value_packed_size,
)
from niah.kv.registry import LayerPolicy, get_method
from niah.kv.spec import CacheSpec

# vLLM 0.34.0's centroids.get_centroids(128, 3) and (128, 4), printed by running its solver
VLLM_C128_B3 = [0.02165370, 0.06679026, 0.11872146, 0.19006585]
VLLM_C128_B4 = [0.01135151, 0.03430686, 0.05806053, 0.08330144, 0.11103853, 0.14300190, 0.18282662, 0.24138170]


def test_codebook_is_vllms_unconverged_lloyd_max():
    for bits, half in ((3, VLLM_C128_B3), (4, VLLM_C128_B4)):
        c = gaussian_codebook(128, bits)[0]
        assert torch.allclose(c[len(half) :], torch.tensor(half), atol=2e-8)
        assert torch.allclose(c, -c.flip(0))


def test_hadamard_is_orthonormal_and_symmetric():
    h = sylvester_hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bytes_per_token_are_vllms_formula(d):
    # vLLM's TurboQuantConfig: key_packed_size + value_packed_size, the slot rounded up to even bytes
    expected = {
        128: {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102},
        256: {"turboquant_k8v4": 388, "turboquant_4bit_nc": 262, "turboquant_k3v4_nc": 230, "turboquant_3bit_nc": 198},
    }
    x = torch.randn(1, 2, 5, d)
    for name, (kb, vb, _) in PRESETS.items():
        m = get_method(name)
        per_token = (m.key.quantize(x).nbytes() + m.value.quantize(x).nbytes()) / (2 * 5)
        slot = key_packed_size(d, kb) + value_packed_size(d, vb)
        assert per_token == slot == slot + slot % 2
        if d in expected:
            assert slot == expected[d][name]


def _reference_slot(k: torch.Tensor, v: torch.Tensor, kb: int, vb: int) -> list[int]:
    """One (token, head)'s slot bytes, written from vLLM's store kernel arithmetic with python integers."""
    d, out = k.numel(), []
    if kb == 8:
        out += k.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    else:
        n = k.float().norm()
        y = (k.float() / (n + 1e-8)) @ sylvester_hadamard(d)
        mids = gaussian_codebook(d, kb)[1]
        stream = sum(int((mids <= yi).sum()) << (kb * i) for i, yi in enumerate(y))
        out += list(stream.to_bytes(d * kb // 8, "little")) + n.half().reshape(1).view(torch.uint8).tolist()
    lo, hi = v.float().min(), v.float().max()
    scale = max(float((hi - lo) / (2**vb - 1)), 1e-8)
    codes = [min(max(math.floor((float(x) - float(lo)) / scale + 0.5), 0), 2**vb - 1) for x in v.float()]
    stream = sum(c << (vb * i) for i, c in enumerate(codes))
    out += list(stream.to_bytes(d * vb // 8, "little"))
    out += torch.tensor([scale, float(lo)]).half().view(torch.uint8).tolist()
    return out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_store_bytes_follow_vllms_kernel_arithmetic(name):
    kb, vb, _ = PRESETS[name]
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 2, 4, 64, generator=g) * 3 + 1
    v = torch.randn(1, 2, 4, 64, generator=g)
    m = get_method(name)
    got = torch.cat([m.key.quantize(k).tensors["slot"], m.value.quantize(v).tensors["slot"]], -1)
    for h in range(2):
        for t in range(4):
            assert got[0, h, t].tolist() == _reference_slot(k[0, h, t], v[0, h, t], kb, vb), (name, h, t)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_error_bounds(name):
    kb, vb, _ = PRESETS[name]
    x = torch.randn(1, 2, 512, 128, generator=torch.Generator().manual_seed(0))
    m = get_method(name)
    k_hat, v_hat = m.key.dequantize(m.key.quantize(x)), m.value.dequantize(m.value.quantize(x))
    rel = ((k_hat - x).square().sum(-1) / x.square().sum(-1)).mean()
    assert rel < {8: 1e-3, 4: 0.012, 3: 0.045}[kb], rel  # Lloyd-Max for N(0, 1/d): 0.0095 at 4 bits, 0.034 at 3
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**vb - 1)
    assert ((v_hat - x).abs() <= scale / 2 * 1.01 + 1e-3).all()


def test_fp8_keys_saturate_without_a_scale():
    m = get_method("turboquant_k8v4")
    x = torch.tensor([500.0, -1000.0, 1.9375, 0.001]).view(1, 1, 1, 4).repeat(1, 1, 1, 4)
    assert m.key.dequantize(m.key.quantize(x))[0, 0, 0, :4].tolist() == [
        448.0,
        -448.0,
        2.0,
        x.to(torch.float8_e4m3fn)[0, 0, 0, 3].item(),
    ]


def test_head_dim_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        get_method("turboquant_k3v4_nc").check_head_dim(96)


def test_presets_keep_vllms_layers():
    p = get_method("turboquant_k3v4_nc").layers
    gemma = [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL] + [SLIDING] * 5 + [FULL]
    assert [i for i, kind in enumerate(gemma) if p.stores(i, kind, 18, False)] == [5, 11]
    assert [i for i in range(40) if p.stores(i, FULL, 40, True)] == list(range(40))  # hybrid: no boundary protection
    assert (
        get_method("turbo3").layers == LayerPolicy()
        and get_method("turboquant_k3v4_nc+all_layers").layers == LayerPolicy()
    )
    assert "first and last 2 layers" in p.describe() and "sliding-window" in p.describe()


def _states(kinds, tokens=8, d=32):
    g = torch.Generator().manual_seed(1)

    def x():
        return torch.randn(1, 1, tokens, d, generator=g)

    return [LayerState(k, tokens, x(), x(), None) for k in kinds]


def test_layers_outside_the_policy_are_stored_at_fp16():
    states = _states([FULL] * 6)
    cache = PackedCache.from_states(states, CacheSpec(get_method("turboquant_k3v4_nc")))
    assert [layer.method.name for layer in cache.layers] == [
        "fp16",
        "fp16",
        "turboquant_k3v4_nc",
        "turboquant_k3v4_nc",
        "fp16",
        "fp16",
    ]
    assert cache.nbytes()["total"] == 4 * 8 * 32 * 2 * 2 + 2 * 8 * (key_packed_size(32, 3) + value_packed_size(32, 4))


def test_modifiers():
    m = get_method("q4_0+keys")
    assert (m.key.name, m.value.name) == ("q4_0", "fp16")
    assert get_method("q4_0+values").key.name == "fp16"
    s = get_method("turbo3+sliding").layers
    assert not s.stores(0, FULL, 4, False) and s.stores(0, SLIDING, 4, False)
    assert get_method("turboquant_k3v4_nc+centred@engine").read_mode == "engine"
    for bad in ("q4_0+keys+values", "q4_0+full+sliding", "q4_0+wat", "q4_0@lazy", "q4_0+keys+keys"):
        with pytest.raises(ValueError, match="modifier|read mode"):
            get_method(bad)


def test_pieces_split_at_multiples_of_the_chunk():
    cache = PackedCache.from_states(_states([FULL], tokens=10), CacheSpec(get_method("q8_0@engine"), engine_chunk=16))
    assert [len(p) for p in cache.pieces(list(range(30)))] == [6, 16, 8]
    assert [
        len(p) for p in PackedCache.from_states(_states([FULL]), CacheSpec(get_method("q8_0"))).pieces(list(range(30)))
    ] == [30]
    with pytest.raises(ValueError, match="engine_chunk"):
        PackedCache.from_states(_states([FULL]), CacheSpec(get_method("q8_0@engine")))


def test_long_contexts_in_engine_mode_are_refused():
    specs = {m: CacheSpec.resolve(m, 16384) for m in ("fp16", "q4_0@engine")}
    check_engine_reads(specs, 16384)
    with pytest.raises(ValueError, match="raise niah.engine_chunk to at least 16385"):
        check_engine_reads(specs, 16385)


@pytest.fixture(scope="module")
def context(tiny):
    ids = list(range(40, 240)) * 2
    return tiny, ids[:300], ids[300:340], context_states(prefill(tiny.model, ids[:300], chunk=64))


def _logits(tiny, states, name, ids, fresh=True, chunk=4096):
    cache = PackedCache.from_states(states, CacheSpec.resolve(name, chunk, fresh_prompt=fresh))
    return read_prompt(tiny.model, cache, ids).logits[0]


def test_engine_reads_raw_keys_within_the_first_chunk(context):
    tiny, ctx, question, states = context
    want = tiny.model(input_ids=torch.tensor([ctx + question])).logits[0, -1]  # the prompt as one chunk, all raw
    engine = _logits(tiny, states, "turbo2@engine", question)[-1]
    strict = _logits(tiny, states, "turbo2", question)[-1]
    assert torch.allclose(engine, want, atol=1e-4)
    assert (strict - want).abs().max() > 100 * (engine - want).abs().max()


def test_engine_answers_are_decode_steps_that_read_the_stored_cache(context):
    """The first answer token comes from the prompt's last position (raw reads); the teacher-forced answer after
    it is a run of decode steps and reads what strict mode reads."""
    tiny, _, question, states = context
    answer = list(range(60, 66))
    ask_ = {
        m: ask(
            tiny.model, tiny.tokenizer, PackedCache.from_states(states, CacheSpec.resolve(m, 4096)), question, answer, 8
        )
        for m in ("fp16", "turbo2@engine", "turbo2")
    }
    fp16, engine, strict = (ask_[m].answer_logsoftmax for m in ("fp16", "turbo2@engine", "turbo2"))
    assert torch.allclose(engine[0], fp16[0], atol=1e-4) and not torch.allclose(strict[0], fp16[0], atol=1e-2)
    assert not torch.allclose(engine[1:], fp16[1:], atol=1e-2)
    cached = PackedCache.from_states(states, CacheSpec.resolve("turbo2@engine", 4096))
    read_prompt(tiny.model, cached, question)
    steps = [tiny.model(input_ids=torch.tensor([[t]]), cache=cached, use_cache=True).logits[0, -1] for t in answer[:-1]]
    assert torch.allclose(torch.log_softmax(torch.stack(steps), -1), engine[1:], atol=1e-4)  # one by one, as decoded


def test_engine_short_continuations_read_the_stored_cache(context):
    tiny, _, question, states = context
    assert len(question) <= CONTINUATION_DECODE_THRESHOLD
    # past the first chunk (a cached prefix, or the next chunk), a short pass reads what strict mode reads
    engine = _logits(tiny, states, "turbo2@engine", question, fresh=False)
    assert torch.allclose(engine, _logits(tiny, states, "turbo2", question), atol=1e-5)
    assert torch.allclose(_logits(tiny, states, "turbo2@engine", question, chunk=300), engine, atol=1e-5)


def test_engine_long_continuations_read_their_own_tokens_raw(context):
    tiny, _, _, states = context
    long = list(range(50, 50 + CONTINUATION_DECODE_THRESHOLD + 20))
    engine = _logits(tiny, states, "turbo2@engine", long, fresh=False)
    strict = _logits(tiny, states, "turbo2", long)
    # the same pass over the context dequantized once and stored losslessly, own tokens raw
    deq = PackedCache.from_states(states, CacheSpec(get_method("turbo2")))
    deq_states = [LayerState(s.kind, s.seen, *layer._read(), s.window) for s, layer in zip(states, deq.layers)]
    lossless = PackedCache.from_states(deq_states, CacheSpec.resolve("fp16@engine", 4096, fresh_prompt=False))
    ref = read_prompt(tiny.model, lossless, long).logits[0]
    assert (engine - ref).abs().max() < 0.2 * (strict - ref).abs().max()


def test_hybrid_models_keep_no_boundary_layers():
    kinds = [LINEAR, FULL, FULL, LINEAR]
    states = [s if s.kind != LINEAR else LayerState(LINEAR, 8, linear=_Linear()) for s in _states(kinds)]
    cache = PackedCache.from_states(states, CacheSpec(get_method("turboquant_k3v4_nc")))
    assert [layer.method.name for layer in cache.layers if isinstance(layer, PackedLayer)] == ["turboquant_k3v4_nc"] * 2


class _Linear:
    """A stand-in for a linear-attention layer's states (deep-copied, never read here)."""

    conv_states: dict = {}
    recurrent_states: dict = {}


def test_centring_takes_the_shared_mean_out_and_counts_it():
    g = torch.Generator().manual_seed(2)
    mean = torch.randn(1, 2, 1, 64, generator=g) * 8
    x = torch.randn(1, 2, 100, 64, generator=g) + mean
    plain, centred = get_method("turbo3").key, get_method("turbo3+centred").key
    p = centred.quantize(x)
    assert p.nbytes() == plain.quantize(x).nbytes() + 2 * 64 * 2  # one fp16 mean per head
    err = {q.name: (q.dequantize(q.quantize(x)) - x).square().mean() for q in (plain, centred)}
    assert err["turbo3+centred"] < 0.2 * err["turbo3"]
    later = centred.quantize_after(x[..., :3, :], p)
    assert torch.equal(later.tensors["key_mean"], p.tensors["key_mean"])  # the prefill's mean, reused
    q = torch.randn(1, 2, 2, 64, generator=g)
    assert torch.allclose(centred.scores(p, q), q @ centred.dequantize(p).float().transpose(-1, -2), atol=1e-3)
