"""The measurement protocol: prefill the context once, then ask over a (possibly quantized) cache.

1. :func:`prefill` runs the context through the decoder only (no LM head), in chunks, into a
   ``DynamicCache``.  The same prefill serves every KV method of a cell (paired comparisons).
2. :func:`context_states` takes each layer's context out of it (keys and values of attention layers, the
   recurrent state of linear-attention ones) and a KV method stores it in a :class:`~niah.kv.cache.PackedCache`.
3. :func:`ask` runs the question over the packed cache, so every question and answer token reads the
   quantized context (no "prefill gap"; in the ``engine`` read mode, as vLLM reads it: :mod:`niah.kv.cache`), then
   * teacher-forces the expected answer: its log-probability and the per-position log-softmax
     (for KL and top-1 agreement against the reference method), and
   * decodes greedily for the scored text (from the first token where the teacher-forced argmax leaves
     the expected answer; see :func:`ask`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from ..kv.cache import LayerState, PackedCache
from ..kv.layout import FULL, LINEAR, SLIDING, UnsupportedLayout
from ..kv.registry import KVMethod
from ..kv.spec import CacheSpec
from .scoring import answer_ended, string_match_all


@torch.no_grad()
def prefill(model, ids: list[int], cache: DynamicCache | None = None, chunk: int = 1024) -> DynamicCache:
    """Append ``ids`` to ``cache`` (a new one if None) through the decoder, ``chunk`` tokens at a time."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    device = next(model.parameters()).device
    for i in range(0, len(ids), chunk):
        piece = torch.tensor([ids[i : i + chunk]], device=device)
        model.base_model(input_ids=piece, cache=cache, use_cache=True)
    return cache


def context_states(cache: DynamicCache) -> list[LayerState]:
    """Each layer's context now, a snapshot that later prefills into ``cache`` leave as it is.

    Keys and values ``(batch, kv_heads, tokens, head_dim)`` of attention layers (a sliding layer: its last
    ``window - 1`` tokens, also when the cache records the past for :meth:`~transformers.Cache.crop`); a copy of
    each linear-attention layer, whose states transformers updates in place."""
    seen = int(cache.get_seq_length())  # transformers >= 5.25 may return a layer's live counter tensor
    out = []
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            out.append(LayerState(LINEAR, seen, linear=copy.deepcopy(layer)))
        elif type(layer) is DynamicSlidingWindowLayer:
            keep = layer.sliding_window - 1
            out.append(
                LayerState(
                    SLIDING, seen, layer.keys[..., -keep:, :], layer.values[..., -keep:, :], layer.sliding_window
                )
            )
        elif type(layer) is DynamicLayer:
            out.append(LayerState(FULL, seen, layer.keys, layer.values))
        else:
            raise UnsupportedLayout(
                f"layer {i} keeps a {type(layer).__name__}, which this repo's cache cannot store (it stores "
                "full-attention, sliding-window and linear-attention layers): use a model whose layers are of those "
                "types"
            )
    return out


def kv_entries(states: list[LayerState]) -> int:
    """Key and value entries the attention layers of ``states`` hold (bits per value = 8 * bytes / this)."""
    return sum(s.keys.numel() * 2 for s in states if s.kind != LINEAR)


@dataclass
class Answer:
    text: str
    answer_logprob: float  # sum over the expected answer's tokens, teacher-forced
    answer_logsoftmax: torch.Tensor  # (answer_tokens, vocab) log-probabilities at each answer position
    decode_s_per_token: float
    question_s: float


@torch.no_grad()
def ask(
    model, tokenizer, cache: PackedCache, question_ids: list[int], answer_ids: list[int], max_new_tokens: int
) -> Answer:
    """Question pass over ``cache`` (mutated), teacher-forced answer, and greedy generation.

    Greedy decoding picks the argmax at every step, so it reproduces the expected answer for exactly as many
    tokens as the teacher-forced argmax agrees with it: those tokens are taken from the teacher-forced pass,
    and decoding runs step by step only from the first disagreement (when every answer token agrees, the
    generation is the expected answer and no decode step runs; ``decode_s_per_token`` is then NaN).  Storing
    the agreeing tokens as one block reads back the same keys and values as storing them step by step (every
    method codes a token with its layer's first-block parameters, or whole groups of the oldest tokens; the
    tests check it).
    """
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    out = read_prompt(model, cache, question_ids, logits_to_keep=1)
    question_s = time.perf_counter() - t0

    forced = model(input_ids=torch.tensor([answer_ids], device=device), cache=cache.clone(), use_cache=True)
    logsm = torch.log_softmax(torch.cat([out.logits[0, -1:], forced.logits[0, :-1]]).float(), dim=-1)
    answer_logprob, j = teacher_forced(logsm, answer_ids)
    if j == len(answer_ids):
        return Answer(
            tokenizer.decode(answer_ids, skip_special_tokens=True),
            answer_logprob,
            logsm.cpu(),
            float("nan"),
            question_s,
        )
    if j:
        model(input_ids=torch.tensor([answer_ids[:j]], device=device), cache=cache, use_cache=True, logits_to_keep=1)

    def step(token: int) -> int:
        return int(
            model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True).logits[0, -1].argmax()
        )

    generated = answer_ids[:j] + [int(logsm[j].argmax())]
    decode_s = greedy_from(generated, step, max_new_tokens, tokenizer.eos_token_id, tokenizer.decode)
    return Answer(
        tokenizer.decode(generated, skip_special_tokens=True), answer_logprob, logsm.cpu(), decode_s, question_s
    )


def read_prompt(model, cache: PackedCache, ids: list[int], logits_to_keep: int = 0):
    """Run prompt tokens ``ids`` over ``cache`` in the passes its read mode takes (:meth:`PackedCache.pieces`), then
    end the prompt (later passes are decode steps); the model output of the last pass (``logits_to_keep=0``: the
    logits of every position of every pass, joined)."""
    device = next(model.parameters()).device
    outs = [
        model(input_ids=torch.tensor([p], device=device), cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
        for p in cache.pieces(ids)
    ]
    cache.end_prompt()
    if not logits_to_keep and len(outs) > 1:
        outs[-1].logits = torch.cat([o.logits for o in outs], dim=1)
    return outs[-1]


def teacher_forced(logsm: torch.Tensor, answer_ids: list[int]) -> tuple[float, int]:
    """From the answer positions' next-token log-softmax ``(len(answer_ids), vocab)``: the expected answer's log-prob,
    and how many of its leading tokens greedy decoding reproduces (the argmax agrees with each of them)."""
    target = torch.tensor(answer_ids, device=logsm.device)
    agree = (logsm.argmax(-1) == target).int()
    return logsm.gather(1, target[:, None]).sum().item(), int(agree.cumprod(0).sum())


def greedy_from(generated: list[int], step, max_new_tokens: int, eos: int, decode) -> float:
    """Extend ``generated`` (in place) with ``step(last token) -> next token`` until it holds ``max_new_tokens``, ends
    with ``eos``, or its answer line ends (:func:`~niah.experiments.scoring.answer_ended` of ``decode(generated)``);
    return the seconds per step (NaN when no step ran)."""
    start, t0 = len(generated), time.perf_counter()
    while len(generated) < max_new_tokens and generated[-1] != eos and not answer_ended(decode(generated)):
        generated.append(step(generated[-1]))
    steps = len(generated) - start
    return (time.perf_counter() - t0) / steps if steps else float("nan")


def compare_logits(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || other), mean top-1 agreement) over positions; inputs are ``(positions, vocab)`` log-softmax."""
    kl = (ref.exp() * (ref - other)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    return max(kl, 0.0), top1


def scored_fields(ans: Answer, expected: list[str], ref_logsoftmax: torch.Tensor) -> dict:
    """The scored columns of any engine's answer: the greedy text against ``expected``, the answer log-prob, and KL and
    top-1 agreement against the reference's answer-position log-softmax."""
    kl, top1 = compare_logits(ref_logsoftmax, ans.answer_logsoftmax)
    return {
        "expected": expected,
        "generated": ans.text,
        "score": string_match_all(ans.text, expected),
        "answer_logprob": ans.answer_logprob,
        "kl_vs_ref": kl,
        "top1_vs_ref": top1,
    }


def answer_fields(
    ans: Answer,
    expected: list[str],
    ref_logsoftmax: torch.Tensor,
    nbytes: dict,
    values: int,
    method: KVMethod,
    head_dim: int,
) -> dict:
    """The scored columns of a needle row (:func:`scored_fields`) and the stored bytes by layer type (``nbytes``:
    :meth:`PackedCache.nbytes`; ``values``: K and V entries of the context, for bits per value)."""
    return {
        **scored_fields(ans, expected, ref_logsoftmax),
        "kv_bytes": nbytes["total"],
        "kv_bytes_packed": nbytes["packed"],
        "kv_bytes_residual": nbytes["residual"],
        "kv_bytes_full_attention": nbytes[FULL],
        "kv_bytes_sliding_attention": nbytes[SLIDING],
        "linear_state_bytes": nbytes["linear_state"],
        "bits_per_value": 8 * nbytes["total"] / values,
        "analytical_bits": method.analytical_bits(head_dim),
        "read_mode": method.read_mode,
        "layer_policy": method.layers.describe(),
        "question_s": ans.question_s,
        "decode_s_per_token": ans.decode_s_per_token,
    }


def run_method(
    model, tokenizer, states, spec: CacheSpec, question_ids, answer_ids, max_new_tokens
) -> tuple[Answer, dict, float]:
    """Store the context ``states`` as ``spec`` says and ask; returns (answer, stored bytes, quantize seconds)."""
    t0 = time.perf_counter()
    cache = PackedCache.from_states(states, spec)
    quantize_s = time.perf_counter() - t0
    stored = cache.nbytes()
    return ask(model, tokenizer, cache, question_ids, answer_ids, max_new_tokens), stored, quantize_s
