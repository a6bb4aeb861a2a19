"""Weight quantization: quantizers, packing, salience, masks, AWQ, AutoRound, the cache, the metrics (tiny tensors
and models)."""

import copy

import pytest
import torch

from niah.weightquant import autoround
from niah.weightquant.awq import output_error, scales_for, search_scale
from niah.weightquant.cache import cached
from niah.weightquant.data import split_keys
from niah.weightquant.evaluate import Evaluator, repetition
from niah.weightquant.pack import PackedLinear, pack_bits, unpack_bits
from niah.weightquant.quant import fake_quant_tokens, fake_quant_weight, quantize_weight
from niah.weightquant.salience import (
    collect_inputs,
    decoder_linears,
    kurtosis,
    magnitude_prune,
    select_channels,
    uncoded_weights,
    zero_channels,
)
from niah.weightquant.schemes import QuantizedModel, Scheme, layer_bits, more_bits_layer, rtn_layers, schemes_01


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sym", [True, False])
def test_int8_per_token_activation_round_trip_is_within_half_a_step(sym):
    x = _randn(3, 20, 64)
    x[..., 5] *= 30  # an outlier channel
    err = (fake_quant_tokens(x, 8, sym) - x).abs()
    if sym:
        step = x.abs().amax(-1, keepdim=True) / 127
    else:
        step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    assert (err <= step / 2 + 1e-6).all()
    assert err.max() > 0


@pytest.mark.parametrize("sym", [True, False])
def test_w4_group_quantization_round_trip_bound(sym):
    w = _randn(32, 128)
    q = quantize_weight(w, 4, group=64, sym=sym)
    assert q.codes.shape == (32, 2, 64) and q.scale.shape == (32, 2) and q.scale.dtype == torch.float16
    assert int(q.codes.max()) <= 15
    step = q.scale.float().abs()[..., None]
    err = (q.dequantize() - w).view(32, 2, 64).abs()
    if sym:  # the largest magnitude maps to -8 exactly; only the other side can clip, by at most one step
        inside = w.view(32, 2, 64).abs() <= 7.5 * step
        assert (err[inside] <= step.expand_as(err)[inside] / 2 + 1e-6).all()
        assert (err <= step + 1e-6).all()
    else:
        assert (err <= step / 2 + 1e-6).all()


def test_symmetric_rtn_equals_auto_round_at_zero_iterations():
    pytest.importorskip("auto_round")
    from auto_round.data_type.int import quant_tensor_sym

    w = _randn(16, 128, seed=3)
    theirs, _, _ = quant_tensor_sym(w, bits=4, group_size=64)
    assert torch.equal(fake_quant_weight(w, 4, 64, sym=True), theirs)


def test_group_must_divide_the_input_channels():
    with pytest.raises(ValueError, match="not a multiple of group 128"):
        quantize_weight(_randn(8, 576), 4, group=128)


@pytest.mark.parametrize("bits", [3, 4, 6, 8])
def test_bit_packing_round_trips_and_takes_bits_per_code(bits):
    codes = torch.randint(0, 2**bits, (7, 3, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.int64).to(
        torch.uint8
    )
    packed = pack_bits(codes, bits)
    assert packed.numel() == -(-codes.numel() * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, codes.shape), codes)


def test_packed_linear_stores_what_it_dequantizes():
    w = _randn(24, 128)
    q = quantize_weight(w, 4, 64, sym=False)
    p = PackedLinear.from_qweight(q, (24, 128), 64)
    assert torch.equal(p.dense(), q.dequantize())
    assert p.nbytes() == 24 * 128 // 2 + 24 * 2 * 2 + 24 * 2 // 2  # codes, fp16 scales, 4-bit zero points


def test_salience_finds_a_planted_channel_and_shared_inputs_share_it(tiny):
    model = copy.deepcopy(tiny.model)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight[7] *= 50.0
    stats = collect_inputs(
        model, torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)), sample_tokens=16, seed=0
    )
    q, k = stats["model.layers.0.self_attn.q_proj"], stats["model.layers.0.self_attn.k_proj"]
    assert q is k and q.sample.shape == (16, 128)
    assert int(q.mean_abs.argmax()) == 7
    assert 7 in select_channels(q.mean_abs, 0.01, "activation").tolist()


def test_channel_mask_and_magnitude_pruning_have_exact_sparsity():
    w = _randn(40, 200)
    sal = torch.rand(200, generator=torch.Generator().manual_seed(1))
    masked = zero_channels(w, sal, 0.3)
    dead = (masked == 0).all(0)
    assert int(dead.sum()) == 60
    assert set(dead.nonzero().flatten().tolist()) == set(sal.topk(60, largest=False).indices.tolist())
    assert torch.equal(masked[:, ~dead], w[:, ~dead])
    pruned = magnitude_prune(w, 0.3)
    assert int((pruned == 0).sum()) == round(0.3 * w.numel())
    assert pruned[pruned != 0].abs().min() >= w[pruned == 0].abs().max()


def test_repetition_metric():
    assert repetition([1, 2, 3, 4, 1, 2, 3, 4])["repeat_share"] == pytest.approx(1 / 5)
    assert repetition(list(range(50)))["repeat_share"] == 0.0
    r = repetition(list(range(130)) + [7, 8, 9, 10] * 40, edges=(128,))
    assert r["repeat_by_segment"]["0-128"] == 0.0 and r["repeat_by_segment"]["128-287"] > 0.9


def test_awq_search_follows_the_definition_and_beats_rtn_on_a_salient_channel():
    x = _randn(256, 64, seed=2)
    x[:, 3] *= 25.0
    ws = [_randn(32, 64, seed=5), _randn(16, 64, seed=6)]
    quant = lambda w: fake_quant_weight(w, 3, 64, sym=False)  # noqa: E731
    mean_abs = x.abs().mean(0)
    r = search_scale(ws, x, mean_abs, quant, grid=10)
    losses = [output_error(ws, x, scales_for(mean_abs, i / 10), quant) for i in range(10)]
    assert r.alpha == pytest.approx(min(range(10), key=losses.__getitem__) / 10)
    ratio = r.scale / mean_abs.pow(r.alpha)  # s = s_x^alpha up to one constant
    assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-4)
    rtn = sum(float((x @ quant(w).T - x @ w.T).pow(2).mean()) for w in ws)
    assert losses[0] == pytest.approx(rtn, rel=1e-5)  # alpha 0 is round-to-nearest
    assert r.alpha > 0 and float(r.losses.min()) < rtn


def test_scheme_changes_logits_inside_the_block_and_restores_the_model(tiny):
    model = tiny.model
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    before = {n: m.weight for n, m in decoder_linears(model).items()}
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        sch = Scheme("W4A8", w_bits=4, group=64, a_bits=8)
        qm = QuantizedModel(sch, rtn_layers(model, sch))
        with qm.applied(model):
            q = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.equal(q, ref)
    assert torch.equal(after, ref)
    assert all(m.weight is before[n] for n, m in decoder_linears(model).items())
    assert all(not m._forward_pre_hooks for m in decoder_linears(model).values())


def test_more_bits_follows_llama_cpps_q4_k_m_rule():
    # the layers whose attn_v is Q8_0 and ffn_down Q6_K in Gemma-3-270M's Q4_K_M GGUF (18 layers; read with gguf)
    assert [i for i in range(18) if more_bits_layer(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]
    # 32 layers (a Llama-3-8B-sized stack): llama.cpp's rule gives 4 + 4 + every third of the 24 between = 16
    assert sum(more_bits_layer(i, 32) for i in range(32)) == 16


def test_more_bits_refuses_autoround():
    with pytest.raises(ValueError, match="AutoRound codes one width"):
        Scheme("w4 ar mixed", w_bits=4, group=32, rounding="autoround", more_bits=6)


def test_mixed_scheme_stores_more_bits_only_where_the_rule_says(tiny, smoke_cfg):
    model = tiny.model
    mixed = schemes_01(smoke_cfg.weightquant)["w4a16_mixed"]
    bits = layer_bits(model, mixed)
    more = {n for n, b in bits.items() if b == mixed.more_bits}
    # 2 layers: only the last one (index >= 7 * 2 // 8) is favoured, and in it attn_v and ffn_down
    assert more == {n for n in bits if ".layers.1." in n and n.endswith(("v_proj", "down_proj"))}
    assert set(bits.values()) == {4, mixed.more_bits}
    layers = rtn_layers(model, mixed)
    for n, p in layers.items():
        m = decoder_linears(model)[n]
        out, inp = m.weight.shape
        # bytes as promised: packed codes at the layer's bits plus one fp16 scale per group
        assert p.bits == bits[n] and p.nbytes() == out * inp * bits[n] // 8 + out * (inp // mixed.group) * 2
        # symmetric codes clip by at most one step on the short side, plus the fp16 scale's rounding times the codes
        step = p.scale.float().abs()  # (out, groups)
        err = (p.dense() - m.weight.detach().float()).reshape(out, -1, mixed.group).abs().amax(-1)
        assert bool((err <= step * (1 + 2 ** (bits[n] - 1) * 2**-11)).all())
    plain = schemes_01(smoke_cfg.weightquant)["w4a16_rtn_block"]
    assert plain.group == mixed.group and not plain.more_bits
    extra = sum(decoder_linears(model)[n].weight.numel() * (mixed.more_bits - 4) // 8 for n in more)
    mixed_bytes = QuantizedModel(mixed, layers).linear_bytes(model)
    assert mixed_bytes == QuantizedModel(plain, rtn_layers(model, plain)).linear_bytes(model) + extra


@pytest.mark.parametrize("bits", [4, 5, 7])
def test_the_mixed_schemes_wider_bits_are_a_packed_width_above_four(smoke_with, bits):
    from niah.config import ConfigError

    with pytest.raises(ConfigError, match=f"weightquant.more_bits must be 6 or 8 .*got {bits}"):
        smoke_with("weightquant", more_bits=bits)


def test_evaluator_scores_fp32_against_itself(tiny):
    ev = Evaluator(tiny.model, torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    m = ev.measure(QuantizedModel(Scheme("fp32")))
    assert (
        m["ppl"] == pytest.approx(m["ppl_fp32"])
        and m["kl_vs_fp32"] == pytest.approx(0, abs=1e-6)
        and m["top1_vs_fp32"] == 1.0
    )
    assert m["eval_tokens"] == 2 * 15


def test_calibration_cache_hit_and_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path))
    calls = []
    w = _randn(8, 64)

    def build():
        calls.append(1)
        return {"l": PackedLinear.from_qweight(quantize_weight(w, 4, 64), (8, 64), 64)}, {"iters": 3}

    first = cached({"model": "m", "calibration": "abc"}, build)
    second = cached({"model": "m", "calibration": "abc"}, build)
    other = cached({"model": "m", "calibration": "abd"}, build)
    assert (first.hit, second.hit, other.hit) == (False, True, False) and len(calls) == 2
    assert second.record == {"iters": 3} and torch.equal(second.layers["l"].dense(), first.layers["l"].dense())
    assert list(tmp_path.glob("weightquant/*/linears.safetensors")) and not list(tmp_path.rglob("*.pt"))


def test_unsupported_scheme_is_a_clear_error(monkeypatch):
    pytest.importorskip("auto_round")
    with pytest.raises(autoround.UnsupportedScheme, match="no scheme 'W4A8'.*INT8"):
        autoround.scheme(4, 64, True, preset="W4A8")

    def missing(name):
        raise autoround.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(autoround.importlib.metadata, "version", missing)
    with pytest.raises(autoround.UnsupportedScheme, match="pip install auto-round"):
        autoround.scheme(4, 64, True)


def test_autoround_codes_reproduce_its_quantized_weights():
    pytest.importorskip("auto_round")
    from transformers import LlamaConfig, LlamaForCausalLM

    from niah.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=258,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
        )
    )
    windows = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    layers, record = autoround.calibrate(
        model, ByteTokenizer(), windows, bits=4, group=64, sym=True, iters=1, batch_size=2, amp=False, seed=0
    )
    assert (
        set(layers) == set(decoder_linears(model))
        and record["iters"] == 1
        and record["samples"] == 2
        and record["wall_s"] >= 0
    )
    w = model.model.layers[0].self_attn.q_proj.weight  # untouched: AutoRound worked on a copy
    deq = layers["model.layers.0.self_attn.q_proj"].dense()
    assert record["tuned_in"] == "torch.float32"
    assert (deq - w).abs().max() <= layers["model.layers.0.self_attn.q_proj"].scale.float().abs().max() * 1.01


def test_calibration_and_evaluation_keys_are_disjoint_and_cover_the_corpus():
    from pydoc_data.topics import topics

    calib, held = split_keys(0.25)
    assert calib and held and not set(calib) & set(held) and set(calib) | set(held) == set(topics)


def test_unknown_weightquant_setting_is_an_error(smoke_cfg):
    from niah.config import ConfigError

    with pytest.raises(ConfigError, match=r"unknown weightquant setting\(s\) \[.iters.\]"):
        smoke_cfg.updated("weightquant", iters=3)
    assert kurtosis(_randn(200_000)) == pytest.approx(3.0, abs=0.05)


def test_autoround_on_the_first_blocks_tunes_only_those_and_leaves_the_model_whole(smoke_cfg, tiny):
    pytest.importorskip("auto_round")
    windows = torch.randint(0, 250, (2, 16))
    before = {n: m.weight.clone() for n, m in decoder_linears(tiny.model).items()}
    layers, record = autoround.calibrate(tiny.model, tiny.tokenizer, windows, 4, 32, True, 1, 2, False, 0, blocks=1)
    assert set(layers) == {n for n in before if n.startswith("model.layers.0.")} and record["blocks"] == 1
    assert len(tiny.model.base_model.layers) == 2 and tiny.model.config.num_hidden_layers == 2
    assert uncoded_weights(tiny.model) == {}  # a dense model: every decoder weight is in a linear
    assert all((m.weight == before[n]).all() for n, m in decoder_linears(tiny.model).items())
    with pytest.raises(ValueError, match="needs 1 to 2 blocks"):
        autoround.first_blocks(tiny.model, 3)


def test_autoround_calibrates_a_model_with_linear_attention_layers_and_codes_every_linear():
    """Qwen3.5's layout: auto-round's shared block inputs used to carry a 2D mask into the full-attention block."""
    pytest.importorskip("auto_round")
    from conftest import HYBRID_SPECS

    from niah.models import load_model

    lm = load_model(HYBRID_SPECS["qwen3_5_moe"])
    windows = torch.randint(0, 250, (2, 16))
    layers, record = autoround.calibrate(lm.model, lm.tokenizer, windows, 4, 32, True, 1, 2, False, 0, blocks=4)
    assert set(layers) == set(
        decoder_linears(lm.model)
    )  # the full-attention block (layer 2) included; no unfused experts
    experts = {f"model.layers.{i}.mlp.experts.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")}
    assert set(uncoded_weights(lm.model)) == experts | {
        f"model.layers.{i}.mlp.gate.weight" for i in range(4)
    }  # and the routers
    assert record["rtn_layers"] and set(record["rtn_layers"]) < set(layers)  # the ones auto-round leaves are named
    for name in record["rtn_layers"]:
        w = decoder_linears(lm.model)[name].weight.float()
        assert (layers[name].dense() - w).abs().max() <= w.abs().max() / 7 + 1e-6  # within one 4-bit step
