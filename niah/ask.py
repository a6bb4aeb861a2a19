"""Your model, your document: one question about a context, asked through several KV methods and paired with fp16.

:func:`ask` takes text, :func:`ask_ids` token ids.  Both follow the battery's protocol
(:mod:`niah.experiments.protocol`): the context is prefilled once, raw; each method stores it
(:meth:`~niah.kv.cache.PackedCache.from_states`) and the question reads the stored cache, ``strict`` as after a
prefix-cache hit, ``@engine`` as vLLM reads a fresh prompt.  So a row here is the row the battery writes for the same
ids (tests/test_ask.py checks it).  For ``model.generate()`` itself, see :func:`niah.kv.cache.cache_for`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch

from .data.haystack import split_sentences
from .data.needles import INTRO, NOUN, Trial, needle_text, question_texts
from .experiments.protocol import compare_logits, context_states, kv_entries, prefill, run_method
from .experiments.scoring import string_match_all
from .experiments.specs import check_engine_reads
from .kv.cache import refuse_static
from .kv.spec import CacheSpec

REFERENCE = "fp16"  # every method is paired with it
QUESTION = "\n\nQuestion: {question}\nAnswer:"  # what follows a context without a needle


@dataclass(frozen=True)
class Needle:
    """A needle for :func:`ask`: the battery's sentence " One of the special magic numbers for <key> is: <value>." put
    at the sentence start nearest to ``depth`` of the context (0: its start, 1: its end)."""

    key: str
    value: str
    depth: float = 0.5


def ask(
    model,
    tokenizer,
    context: str,
    question: str | None = None,
    methods: list[str] = (REFERENCE,),
    *,
    needle: Needle | None = None,
    max_new_tokens: int = 32,
    engine_chunk: int = 16384,
    prefill_chunk: int = 1024,
) -> pd.DataFrame:
    """Ask ``question`` about ``context`` through each KV method of ``methods`` (fp16 always, first); one row each.

    Without ``needle`` the prompt is ``context`` then :data:`QUESTION`, and the reference answer is fp16's greedy
    one.  With ``needle`` (:class:`Needle`) the battery's intro, needle, question and answer prefix frame the context
    (``question`` is not used), the reference answer is the needle's value and each row is scored.  Columns: the
    greedy ``answer``; ``answer_logprob``, the reference answer's log-probability teacher-forced (fp16's own answer,
    or the value); ``kl_first_token`` against fp16; ``kv_bytes`` stored and ``bits_per_value``; the shared
    ``prefill_s``, the method's ``quantize_s``, ``question_s`` and ``decode_s_per_token`` (NaN: no decode step ran,
    as the teacher-forced pass already gave the greedy answer).  Raises ``ValueError`` for an empty context, an
    unknown method, or a prompt longer than the model allows."""
    if not context.strip():
        raise ValueError("the context is empty: give the text to ask about")
    if needle is None and not (question or "").strip():
        raise ValueError("no question: give one, or a needle whose question is asked")
    expected, answer_ids = None, None
    if needle is None:
        after = QUESTION.format(question=question.strip())
    else:
        context = INTRO.format(nouns=NOUN["number"] + "s") + _with_needle(context, needle)
        question, prefix = question_texts(Trial([(needle.key, needle.value)], [needle.key], [needle.value], "number"))
        after, expected = question + prefix, [needle.value]
        answer_ids = tokenizer.encode(" " + needle.value, add_special_tokens=False)
    return ask_ids(
        model,
        tokenizer,
        tokenizer.encode(context),  # with the BOS token of tokenizers that use one
        tokenizer.encode(after, add_special_tokens=False),
        methods,
        answer_ids,
        expected,
        max_new_tokens=max_new_tokens,
        engine_chunk=engine_chunk,
        prefill_chunk=prefill_chunk,
    )


def _with_needle(context: str, needle: Needle) -> str:
    """``context`` with the needle's sentence at the sentence start nearest to ``needle.depth`` of its characters."""
    if not 0.0 <= needle.depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1] (0: the context's start, 1: its end); got {needle.depth}")
    pieces, at = split_sentences(context), [0]
    for p in pieces:
        at.append(at[-1] + len(p))
    i = min(range(len(at)), key=lambda j: abs(at[j] - needle.depth * len(context)))
    return "".join(pieces[:i]) + needle_text("number", needle.key, needle.value) + "".join(pieces[i:])


@torch.no_grad()
def ask_ids(
    model,
    tokenizer,
    context_ids: list[int],
    question_ids: list[int],
    methods: list[str],
    answer_ids: list[int] | None = None,
    expected: list[str] | None = None,
    *,
    max_new_tokens: int = 32,
    engine_chunk: int = 16384,
    prefill_chunk: int = 1024,
) -> pd.DataFrame:
    """:func:`ask` on token ids: ``answer_ids``, the reference answer (None: fp16's greedy one); ``expected``, the
    values that score a row (None: no ``score`` column)."""
    names = list(dict.fromkeys([REFERENCE, *methods]))
    specs = {m: CacheSpec.resolve(m, engine_chunk) for m in names}  # an unknown method: one ValueError, before work
    for name, spec in specs.items():
        refuse_static(name, spec.method)
    check_engine_reads(specs, len(context_ids))
    limit = model.config.get_text_config().max_position_embeddings
    room = max(max_new_tokens, len(answer_ids or []))
    if len(context_ids) + len(question_ids) + room > limit:
        raise ValueError(
            f"the context ({len(context_ids)} tokens) with the question ({len(question_ids)}) and room for {room} "
            f"answer tokens exceeds the model's limit of {limit} tokens: shorten the context or lower max_new_tokens"
        )
    t0 = time.perf_counter()
    states = context_states(prefill(model, context_ids, chunk=prefill_chunk))
    prefill_s = time.perf_counter() - t0
    if answer_ids is None:  # the reference answer is fp16's own: its greedy text, then teacher-forced like the others
        eos = [tokenizer.eos_token_id]  # a one-token "answer" to teacher-force: greedy decoding runs from its start
        first, _, _ = run_method(model, tokenizer, states, specs[REFERENCE], question_ids, eos, max_new_tokens)
        answer_ids = tokenizer.encode(first.text, add_special_tokens=False) or [tokenizer.eos_token_id]
    rows, ref = [], None
    for name in names:
        ans, nbytes, quantize_s = run_method(
            model, tokenizer, states, specs[name], question_ids, answer_ids, max_new_tokens
        )
        ref = ans.answer_logsoftmax if ref is None else ref
        rows.append(
            {
                "method": name,
                "answer": ans.text,
                **({"score": string_match_all(ans.text, expected)} if expected else {}),
                "answer_logprob": ans.answer_logprob,
                "kl_first_token": compare_logits(ref[:1], ans.answer_logsoftmax[:1])[0],
                "kv_bytes": nbytes["total"],
                "bits_per_value": 8 * nbytes["total"] / kv_entries(states),
                "prefill_s": prefill_s,
                "quantize_s": quantize_s,
                "question_s": ans.question_s,
                "decode_s_per_token": ans.decode_s_per_token,
            }
        )
    table = pd.DataFrame(rows).set_index("method")
    table.attrs = {"context_tokens": len(context_ids), "reference_answer": tokenizer.decode(answer_ids)}
    return table
