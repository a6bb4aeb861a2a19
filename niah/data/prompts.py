"""Token ids of one cell: the context to prefill, the question to ask over it, and the expected answer.

Two prompt styles:

* ``completion``: RULER's intro, the context, the question, then an answer prefix that the model completes;
* ``chat``: the same text as the user turn of the tokenizer's chat template, with the answer prefix
  opening the assistant turn.

Each part is tokenized on its own with ``add_special_tokens=False``; the only special tokens are the ones
the chat template writes (and a BOS at position 0 where the tokenizer uses one).
"""

from __future__ import annotations

from dataclasses import dataclass

from .haystack import TokenHaystack
from .needles import INTRO, NOUN, Trial, insert_needles, needle_text, question_texts

STYLES = ("completion", "chat")
_MARK = "\x00CONTEXT\x00"


@dataclass
class CellPrompt:
    prefill_ids: list[int]  # intro + haystack with needles; exactly the cell's length
    question_ids: list[int]
    answer_ids: list[int]
    expected: list[str]
    needle_at: int  # token index of the target needle in prefill_ids
    shared_prefix: int  # leading tokens identical for every cell of this config (intro + haystack before any needle)


def frame(tokenizer, style: str, intro: str, question: str, answer_prefix: str) -> tuple[str, str]:
    """Text before and after the context for ``style``."""
    if style == "completion":
        return intro, question + answer_prefix
    if style == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "prompt style 'chat' needs a tokenizer with a chat template; this one has none: use 'completion'"
            )
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": intro + _MARK + question}], add_generation_prompt=True, tokenize=False
        )
        before, after = text.split(_MARK)
        return before, after + answer_prefix.lstrip()
    raise ValueError(f"unknown prompt style {style!r}: choose {', '.join(STYLES)}")


def build_cell(tokenizer, hay: TokenHaystack, length: int, depth: float, trial: Trial, style: str) -> CellPrompt:
    """Ids for a context of exactly ``length`` tokens with the trial's needles at ``depth``."""
    question, answer_prefix = question_texts(trial)
    intro = INTRO.format(nouns=NOUN[trial.kind] + "s")
    before, after = frame(tokenizer, style, intro, question, answer_prefix)
    bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) and style == "completion" else []
    head = bos + tokenizer.encode(before, add_special_tokens=False)
    needles = [tokenizer.encode(needle_text(trial.kind, k, v), add_special_tokens=False) for k, v in trial.needles]
    body, needle_at, shared = insert_needles(hay, length - len(head), depth, needles, trial.extra_positions)
    answer = " " + ", ".join(trial.expected)
    return CellPrompt(
        prefill_ids=head + body,
        question_ids=tokenizer.encode(after, add_special_tokens=False),
        answer_ids=tokenizer.encode(answer, add_special_tokens=False),
        expected=trial.expected,
        needle_at=len(head) + needle_at,
        shared_prefix=len(head) + shared,
    )
