"""The needle battery's contexts in token space: seeded needles at sentence starts, and the ids that ask for each.

:func:`build_context` places the needles of several lengths in one context (the ``multi_key`` battery); with one
length and one needle it is a ``single`` battery prompt.  :func:`single_prompts` and :func:`multi_key_contexts`
build a whole battery's contexts, each on its own stretch of the haystack (:func:`stretch`), and
:data:`DEPTH_RULES` says at which nominal depths of a length its needles go.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .haystack import TokenHaystack
from .needles import INTRO, KEY_WORDS, NOUN, VALUE_KINDS, Trial, needle_text, question_texts
from .prompts import frame


def spread_depths(n: int) -> list[float]:
    """``n`` evenly spread depths from the start (0) to the end (1) of a context."""
    return [k / (n - 1) for k in range(n)] if n > 1 else [0.5]


def centred_depths(n: int) -> list[float]:
    """``n`` depths at the centres of ``n`` equal slices of a context (0.1, 0.3, ..., 0.9 for 5): none at either end."""
    return [round((k + 0.5) / n, 4) for k in range(n)]


DEPTH_RULES = {"spread": spread_depths, "centred": centred_depths}  # by niah.schema.Battery.DEPTHS


@dataclass(frozen=True)
class Question:
    """One needle of one length of one context, with the ids to ask for it."""

    length: int
    context: int
    index: int  # 0 .. needles-1 within its length
    depth: float  # nominal depth in [0, 1] of the first ``length`` tokens
    key: str
    value: str
    position: int  # token index of the needle in the context
    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def trial(self) -> int:
        return self.context * 1000 + self.index


def build_context(
    tokenizer,
    hay: TokenHaystack,
    lengths: list[int],
    needles: int,
    rng: random.Random,
    context: int = 0,
    kind: str = "number",
    style: str = "completion",
    depths: list[float] | None = None,
) -> tuple[list[int], list[Question]]:
    """Ids of one context of ``max(lengths)`` tokens and its questions.

    The needles of length ``L`` go at the last sentence starts before ``depths`` (default ``0, 1/(n-1), ..., 1``)
    of the first ``L`` tokens after the intro (so the deepest still fits); a needle that would straddle a length
    boundary moves just past it, so every length's prefix ends in haystack, never in a cut needle.  ``hay`` must
    hold at least ``max(lengths)`` tokens."""
    keys = rng.sample(KEY_WORDS, needles * len(lengths))
    depths = depths or spread_depths(needles)
    intro = INTRO.format(nouns=NOUN[kind] + "s")
    before, _ = frame(tokenizer, style, intro, "", "")
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) and style == "completion" else []
    out = bos + tokenizer.encode(before, add_special_tokens=False)
    head, plan = len(out), []
    for li, L in enumerate(lengths):
        for k, d in enumerate(depths):
            key, value = keys[li * needles + k], VALUE_KINDS[kind](rng)
            ids = tokenizer.encode(needle_text(kind, key, value), add_special_tokens=False)
            plan.append((head + d * (L - head - len(ids)), L, k, d, key, value, ids))
    cursor, questions = 0, []
    for target, L, k, d, key, value, ids in sorted(plan, key=lambda p: p[0]):
        stop = max(cursor, hay.start_before(cursor + target - len(out)))
        for boundary in lengths:
            if len(out) + stop - cursor < boundary < len(out) + stop - cursor + len(ids):
                stop = cursor + boundary - len(out)
        out += hay.ids[cursor:stop]
        cursor = stop
        if len(out) + len(ids) > L:
            raise ValueError(
                f"battery: {needles} needles per length do not fit in a {L}-token context with the longer lengths' "
                "needles; use fewer needles or longer lengths"
            )
        question, answer_prefix = question_texts(Trial([(key, value)], [key], [value], kind))
        after = frame(tokenizer, style, intro, question, answer_prefix)[1]
        questions.append(
            Question(
                L,
                context,
                k,
                d,
                key,
                value,
                len(out),
                tuple(tokenizer.encode(after, add_special_tokens=False)),
                tuple(tokenizer.encode(" " + value, add_special_tokens=False)),
            )
        )
        out += ids
    out += hay.ids[cursor : cursor + max(lengths) - len(out)]
    if len(out) < max(lengths):
        raise ValueError(f"the haystack holds too few tokens for a {max(lengths)}-token context")
    return out, sorted(questions, key=lambda q: (q.length, q.index))


def stretch(hay: TokenHaystack, c: int, contexts: int, length: int) -> TokenHaystack:
    """Context ``c``'s own stretch of the haystack (the stretches of ``contexts`` contexts are spread over it)."""
    start = hay.start_before(c * (len(hay.ids) - length) / max(contexts - 1, 1))
    return TokenHaystack(hay.ids[start:], [p - start for p in hay.starts if p >= start])


def multi_key_contexts(
    tokenizer, hay: TokenHaystack, contexts: int, groups: list[list[int]], needles: int, rng, kind: str, style: str
) -> list[tuple[list[int], list[Question]]]:
    """Per group of lengths, ``contexts`` contexts of ``(ids, questions)``, each holding ``needles`` needles with
    distinct keys at every length of its group.  With all lengths in one group (``battery.nested``), the first ``L``
    tokens of a context also hold the longer lengths' needles that fall inside them: RULER's multi-key distractors."""
    return [
        build_context(tokenizer, stretch(hay, c, contexts, lengths[-1]), lengths, needles, rng, c, kind, style)
        for lengths in groups
        for c in range(contexts)
    ]


def single_prompts(
    tokenizer, hay: TokenHaystack, contexts: int, lengths: list[int], depths: list[float], rng, kind: str, style: str
) -> list[list[tuple[list[int], Question]]]:
    """Per context, one (ids, question) prompt per needle: one needle at each of ``depths`` at every length, each
    prompt on the context's stretch of haystack with only its own needle."""
    out = []
    for c in range(contexts):
        sub, prompts = stretch(hay, c, contexts, lengths[-1]), []
        for L in lengths:
            for k, d in enumerate(depths):
                ids, (q,) = build_context(tokenizer, sub, [L], 1, rng, c, kind, style, depths=[d])
                prompts.append((ids, replace(q, index=k)))
        out.append(prompts)
    return out
