import dataclasses
import random

import pytest
import torch

from niah.data.haystack import haystack_text, tokenize_haystack
from niah.data.needles import NeedleSpec, make_trial
from niah.data.prompts import build_cell
from niah.experiments.protocol import ask, compare_logits, context_states, prefill
from niah.kv.cache import PackedCache
from niah.kv.registry import get_method
from niah.kv.spec import CacheSpec


@pytest.fixture(scope="module")
def cell(tiny):
    hay = tokenize_haystack(haystack_text("pydoc"), tiny.tokenizer, 600)
    return build_cell(tiny.tokenizer, hay, 400, 0.5, make_trial(NeedleSpec(), random.Random(3)), "completion")


def _ask(tiny, kv, cell, method="fp16", keep=True):
    cache = PackedCache.from_states(kv, CacheSpec(get_method(method), keep_dequantized=keep))
    return ask(tiny.model, tiny.tokenizer, cache, cell.question_ids, cell.answer_ids, 6)


def test_the_question_reads_the_prefilled_cache(tiny, cell):
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=128))
    clean = _ask(tiny, kv, cell)
    gen = torch.Generator().manual_seed(0)
    corrupted = [
        dataclasses.replace(s, values=s.values + torch.randn(s.values.shape, generator=gen)) for s in kv
    ]  # (a reordering would not do: attention ignores key order)
    other = _ask(tiny, corrupted, cell)
    assert abs(clean.answer_logprob - other.answer_logprob) > 1e-3
    kl, top1 = compare_logits(clean.answer_logsoftmax, other.answer_logsoftmax)
    assert kl > 0


def test_protocol_matches_one_full_forward(tiny, cell):
    """Chunked prefill + question pass over the fp32-stored cache == one forward over the whole prompt."""
    from niah.kv.methods.fp16 import CastStorage
    from niah.kv.registry import KVMethod

    fp32 = KVMethod("fp32", CastStorage("fp32", torch.float32), CastStorage("fp32", torch.float32))
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=96))
    ans = ask(
        tiny.model, tiny.tokenizer, PackedCache.from_states(kv, CacheSpec(fp32)), cell.question_ids, cell.answer_ids, 4
    )
    ids = torch.tensor([cell.prefill_ids + cell.question_ids + cell.answer_ids])
    with torch.no_grad():
        full = torch.log_softmax(tiny.model(ids).logits[0].float(), -1)
    n = len(cell.answer_ids)
    expect = full[-n - 1 : -1]
    torch.testing.assert_close(ans.answer_logsoftmax, expect, atol=2e-4, rtol=1e-4)


def test_memoized_dequantization_changes_no_number(tiny, cell):
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=128))
    a = _ask(tiny, kv, cell, "kivi2", keep=True)
    b = _ask(tiny, kv, cell, "kivi2", keep=False)
    assert a.text == b.text
    torch.testing.assert_close(a.answer_logsoftmax, b.answer_logsoftmax, atol=0, rtol=0)


def test_a_lossy_method_changes_the_logits_and_stores_fewer_bytes(tiny, cell):
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=128))
    ref, lossy = _ask(tiny, kv, cell, "fp16"), _ask(tiny, kv, cell, "bf16")
    assert not torch.equal(ref.answer_logsoftmax, lossy.answer_logsoftmax)
    stored = PackedCache.from_states(kv, CacheSpec(get_method("fp16"))).nbytes()
    layers, heads, dim = len(kv), kv[0].keys.shape[1], kv[0].keys.shape[3]
    total = 2 * 2 * layers * heads * dim * len(cell.prefill_ids)
    assert stored == {
        "packed": total,
        "residual": 0,
        "total": total,
        "full_attention": total,
        "sliding_attention": 0,
        "linear_state": 0,
    }


def test_question_tokens_are_stored_quantized_too(tiny, cell):
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=128))
    cache = PackedCache.from_states(kv, CacheSpec(get_method("fp16")))
    ask(tiny.model, tiny.tokenizer, cache, cell.question_ids, cell.answer_ids, 3)
    layer = cache.layers[0]
    assert layer.res_k.shape[-2] == 0  # residual 0: every token went into packed storage
    assert layer.get_seq_length() > len(cell.prefill_ids)


def test_shortcut_generation_equals_step_by_step_greedy(tiny, cell):
    """The greedy text built from the teacher-forced pass is what step-by-step greedy decoding produces."""
    kv = context_states(prefill(tiny.model, cell.prefill_ids, chunk=128))
    cache = PackedCache.from_states(kv, CacheSpec(get_method("fp16")))
    device_ids = torch.tensor([cell.question_ids])
    with torch.no_grad():
        out = tiny.model(input_ids=device_ids, cache=cache, use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(5):
            out = tiny.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    greedy = tiny.tokenizer.decode(tokens)
    # pretend the model's own greedy continuation is the expected answer: the shortcut must return it whole
    ans = ask(
        tiny.model,
        tiny.tokenizer,
        PackedCache.from_states(kv, CacheSpec(get_method("fp16"))),
        cell.question_ids,
        tokens[:4],
        6,
    )
    assert ans.text == tiny.tokenizer.decode(tokens[:4])
    # and with the true (unlikely) answer, generation diverges and is decoded step by step
    fp16 = PackedCache.from_states(kv, CacheSpec(get_method("fp16")))
    other = ask(tiny.model, tiny.tokenizer, fp16, cell.question_ids, cell.answer_ids, 6)
    assert greedy.startswith(other.text)
