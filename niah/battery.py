"""The needle battery: many scored questions per (method, length) for the price of a few prefills.

One context of the longest length holds, for every length ``L`` of the battery, ``needles`` needles with
distinct keys at evenly spread depths of its first ``L`` tokens (``nested: false``: one context per length,
with only its own needles).  Since attention is causal, the first ``L``
tokens of that context are a context of length ``L`` by themselves: the context is prefilled once, in order,
and its state is taken out (:func:`~niah.protocol.context_states`) as the prefill passes each length.  At
each length every method stores that state once, and every question (one per needle of that length) runs
over a clone of the stored cache, so a question costs one short pass against a prefill's minutes.  A
context of length ``L`` thus also holds the longer lengths' needles that fall inside it (distinct keys:
RULER's multi-key distractors).

Rows go to the needle results table with the grid's columns (``depth`` is the needle's nominal depth, so the
depth x length heatmap is a view of the battery), plus ``context`` and ``needle_key``; ``trial`` numbers the
questions of one length.  A killed run resumes where it stopped.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import env
from .grid import Cell, base_row, too_long_reason
from .haystack import TokenHaystack, haystack_text, tokenize_haystack
from .kv.cache import PackedCache
from .kv.layout import CacheLayout
from .kv.registry import get_method
from .needles import INTRO, KEY_WORDS, NOUN, VALUE_KINDS, Trial, needle_text, question_texts
from .prompts import frame
from .protocol import answer_fields, ask, context_states, kv_entries, prefill
from .results import ResultsTable
from .rundir import RunDir, open_table

BATTERY_DEFAULTS = {
    "lengths": [4096, 8192, 16384],
    "contexts": 5,  # prefills of the longest length
    "needles": 10,  # questions per length and context
    "nested": True,  # one context serves every length (False: separate contexts per length, fewer distractors)
    "methods": None,  # None: niah.methods
    "sliding_layers": "quantize",  # or "fp16": sliding-window layers kept at fp16 (PackedCache)
}


def battery_settings(cfg: dict) -> dict:
    s = {**BATTERY_DEFAULTS, **cfg.get("battery", {})}
    unknown = set(s) - set(BATTERY_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown battery setting(s) {sorted(unknown)}; valid: {sorted(BATTERY_DEFAULTS)}")
    s["lengths"] = sorted(s["lengths"])
    methods = s["methods"] or cfg["niah"]["methods"]
    ref = cfg["niah"]["reference"]
    s["methods"] = [ref, *(m for m in methods if m != ref)]
    if s["needles"] * len(s["lengths"]) > len(KEY_WORDS):
        raise ValueError(
            f"battery: {s['needles']} needles x {len(s['lengths'])} lengths need more distinct keys than the {len(KEY_WORDS)} there are"
        )
    return s


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
) -> tuple[list[int], list[Question]]:
    """Ids of one context of ``max(lengths)`` tokens and its questions.

    The needles of length ``L`` go at the last sentence starts before depths ``0, 1/(n-1), ..., 1`` of the first
    ``L`` tokens after the intro (so the deepest still fits); a needle that would straddle a length boundary moves just past it, so every
    length's prefix ends in haystack, never in a cut needle.  ``hay`` must hold at least ``max(lengths)`` tokens."""
    keys = rng.sample(KEY_WORDS, needles * len(lengths))
    depths = [k / (needles - 1) for k in range(needles)] if needles > 1 else [0.5]
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
                f"battery: {needles} needles per length do not fit in a {L}-token context with the longer lengths' needles; "
                "use fewer needles or longer lengths"
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


def run_battery(cfg: dict, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Run every missing (question, method) row of the config's battery; return the results table's path."""
    s = battery_settings(cfg)
    n = cfg["niah"]
    out_path = out_path or RunDir(cfg).file("needles")
    table = open_table(cfg, "needles", out_path)
    methods = {m: get_method(m) for m in s["methods"]}
    for m in methods.values():
        m.check_head_dim(lm.head_dim)
    CacheLayout.from_config(lm.model.config).check_context(s["lengths"][0], lm.name)
    style, kind, ref = n["prompt_styles"][0], n["needle"]["kind"], n["reference"]
    longest = s["lengths"][-1]
    hay = tokenize_haystack(haystack_text(cfg["haystack"], env.ROOT / cfg["haystack_folder"]), lm.tokenizer, longest * s["contexts"])
    rng = random.Random(f"{cfg['seed']}/battery")
    groups = [s["lengths"]] if s["nested"] else [[L] for L in s["lengths"]]
    contexts = []
    for lengths in groups:
        for c in range(s["contexts"]):  # each context from its own stretch of the haystack
            start = hay.start_before(c * (len(hay.ids) - lengths[-1]) / max(s["contexts"] - 1, 1))
            sub = TokenHaystack(hay.ids[start:], [p - start for p in hay.starts if p >= start])
            contexts.append(build_context(lm.tokenizer, sub, lengths, s["needles"], rng, c, kind, style))

    def row(q: Question, method: str) -> dict:
        return {
            **base_row(cfg, lm.name, Cell(style, q.length, round(q.depth, 4), q.trial), method),
            "context": q.context,
            "needle_key": q.key,
        }

    def missing(q: Question) -> list[str]:
        return [m for m in methods if table.key(row(q, m)) not in table.done]

    todo = sum(len(missing(q)) for _, qs in contexts for q in qs)
    if not todo:
        return out_path
    torch.set_num_threads(cfg["threads"])
    bar = tqdm(total=todo, desc=f"needle battery [{cfg['name']}]", unit="row", disable=not progress)
    for ids, questions in contexts:
        if not any(missing(q) for q in questions):
            continue
        cache, done, prefill_s = None, 0, 0.0
        for L in s["lengths"]:
            qs = [q for q in questions if q.length == L and missing(q)]
            if not qs:
                continue
            reason = too_long_reason(cfg, lm, L + max(len(q.question_ids) + max(len(q.answer_ids), n["max_new_tokens"]) for q in qs))
            if reason:
                _append(table, bar, [{**row(q, m), "status": "too_long", "reason": reason} for q in qs for m in missing(q)])
                continue
            try:
                t0 = time.perf_counter()
                cache = prefill(lm.model, ids[done:L], cache, n["prefill_chunk"])
                prefill_s, done = prefill_s + time.perf_counter() - t0, L
                _append(
                    table,
                    bar,
                    _ask_all(
                        lm, context_states(cache), methods, ref, qs, missing, row, n["max_new_tokens"], s["sliding_layers"], prefill_s
                    ),
                )
            except (torch.OutOfMemoryError, MemoryError) as err:
                _append(table, bar, [{**row(q, m), "status": "oom", "reason": str(err)[:300]} for q in qs for m in missing(q)])
                break
    bar.close()
    return out_path


def _append(table: ResultsTable, bar, rows: list[dict]) -> None:
    for r in rows:
        table.append(r)
    bar.update(len(rows))


def _ask_all(
    lm, states, methods: dict, ref: str, qs: list[Question], missing, row, max_new: int, sliding: str, prefill_s: float
) -> list[dict]:
    """Store ``states`` once per method and ask every question of ``qs`` over a clone of it (the reference first,
    whose answer logits the others' KL is taken against)."""
    values, rows, ref_logsm = kv_entries(states), [], {}
    todo = {m for q in qs for m in missing(q)}
    for name in [ref, *(m for m in methods if m != ref and m in todo)]:
        t0 = time.perf_counter()
        stored = PackedCache.from_states(states, methods[name], sliding=sliding)
        quantize_s = time.perf_counter() - t0
        stored.dequantize_now()
        nbytes = stored.nbytes()
        for q in qs:
            ans = ask(lm.model, lm.tokenizer, stored.clone(), list(q.question_ids), list(q.answer_ids), max_new)
            if name == ref:
                ref_logsm[q] = ans.answer_logsoftmax
            if name not in missing(q):
                continue
            rows.append(
                {
                    **row(q, name),
                    "status": "ok",
                    "reason": "",
                    "context_tokens": q.length,
                    "needle_position": q.position / q.length,
                    "answer_tokens": len(q.answer_ids),
                    **answer_fields(ans, [q.value], ref_logsm[q], nbytes, values, methods[name], lm.head_dim),
                    "sliding_layers": sliding,
                    "prefill_s": prefill_s,
                    "quantize_s": quantize_s,
                }
            )
    return rows


def run_needles(cfg: dict, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Notebook 03's needle rows: the battery where the config has a ``battery:`` section, else the grid."""
    from .grid import run_grid

    return (run_battery if cfg["battery"] else run_grid)(cfg, lm, out_path, progress)
