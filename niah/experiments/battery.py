"""The needle battery: many scored questions per (method, length) for the price of a few prefills.

Two designs (``battery.mode``):

* ``single`` (one needle per prompt, the original needle test): each context is a stretch of haystack, and each
  of its questions gets a prompt of its own with only its needle.  The prompts of one context share their
  haystack up to the needle, so that prefix is prefilled once and each question pays only for its needle and
  the text after it (the grid's shared-prefix reuse, :func:`~niah.experiments.grid.extend_shared`).  Each question's
  context is stored once per method.
* ``multi_key`` (RULER's multi-key needles): one context holds every needle of a context, described below.

In ``multi_key`` mode, one context of the longest length holds, for every length ``L`` of the battery, ``needles`` needles with
distinct keys at evenly spread depths of its first ``L`` tokens (``nested: false``: one context per length,
with only its own needles).  Since attention is causal, the first ``L``
tokens of that context are a context of length ``L`` by themselves: the context is prefilled once, in order,
and its state is taken out (:func:`~niah.experiments.protocol.context_states`) as the prefill passes each length.  At
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import env
from ..cluster import Unit, run_units
from ..config import Config
from ..data.haystack import HaystackTooShort, TokenHaystack, haystack_text, tokenize_haystack
from ..data.needles import INTRO, KEY_WORDS, NOUN, VALUE_KINDS, Trial, needle_text, question_texts
from ..data.prompts import frame
from ..kv.cache import PackedCache
from ..kv.layout import CacheLayout
from ..kv.registry import get_method
from ..schema import Battery, ConfigError
from .base import Collect, Experiment, too_long_reason
from .grid import Cell, SharedPrompt, cell_keys, croppable, extend_shared
from .protocol import answer_fields, ask, check_engine_reads, context_states, kv_entries, prefill


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

    The needles of length ``L`` go at the last sentence starts before ``depths`` (default ``0, 1/(n-1), ..., 1``) of the first
    ``L`` tokens after the intro (so the deepest still fits); a needle that would straddle a length boundary moves just past it, so every
    length's prefix ends in haystack, never in a cut needle.  ``hay`` must hold at least ``max(lengths)`` tokens."""
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


def battery_contexts(cfg: Config, lm, s: Battery | None = None) -> list:
    """The battery's contexts, built from the config's seed: in ``single`` mode, per context a list of
    ``(ids, question)`` prompts; in ``multi_key`` mode, ``(ids, questions)`` per context."""
    s = s or cfg.battery
    n = cfg.niah
    style, kind = n.prompt_styles[0], n.needle["kind"]
    need = s.lengths[-1] * s.contexts  # each context its own stretch of text at the longest length
    try:
        hay = tokenize_haystack(haystack_text(cfg.haystack, env.ROOT / cfg.haystack_folder), lm.tokenizer, need, repeat=False)
    except HaystackTooShort as err:
        raise ConfigError(
            f"{err} for the battery's {s.contexts} contexts of {s.lengths[-1]} tokens ({lm.name}'s tokenizer); contexts "
            "cut from a repeated text would be the same text, and count as independent questions. Ask fewer "
            "battery.contexts (and more battery.needles), shorter battery.lengths, or a larger haystack (haystack: folder)"
        ) from None
    rng = random.Random(f"{cfg.seed}/battery")
    return _single_prompts(lm, hay, s, rng, kind, style) if s.mode == "single" else _multi_key_contexts(lm, hay, s, rng, kind, style)


def question_prompts(cfg: Config, lm) -> list[tuple[list[int], Question]]:
    """Every battery question with the ids of its own context (``multi_key``: its context's first ``length`` ids)."""
    return _flat(cfg.battery, battery_contexts(cfg, lm))


def _flat(s: Battery, contexts: list) -> list[tuple[list[int], Question]]:
    if s.mode == "single":
        return [p for prompts in contexts for p in prompts]
    return [(ids[: q.length], q) for ids, qs in contexts for q in qs]


def run_battery(
    cfg: Config,
    lm,
    out_path: Path | None = None,
    progress: bool = True,
    *,
    settings: Battery | None = None,
    lengths: list[int] | None = None,
    methods: list[str] | None = None,
    table: str = "needles",
    tag: dict | None = None,
    label: str = "needle battery",
) -> Path:
    """Run every missing (question, method) row of the config's battery; return the results table's path.

    The keywords serve notebook 01's weights x KV cells: ``settings`` (default ``cfg.battery``) builds the
    questions, of which only those at ``lengths`` are asked (default: all), through ``methods`` (default: the
    battery's; the reference is always asked first), into results table ``table``, with ``tag`` (e.g.
    ``{"weights": ...}``) added to every row's keys, under the progress bar's ``label``.  With a ``cluster:``
    section (and no ``settings``), the units go to Ray workers that load the config's own
    model (so not for a weight-quantized ``lm``), and this process writes their rows as they arrive."""
    s = settings or cfg.battery
    n = cfg.niah
    ref = n.reference
    asked = sorted(lengths or s.lengths)
    exp = Experiment(cfg, table, lm.name, out_path, progress)
    names = list(dict.fromkeys([ref, *(methods or s.methods)]))
    chosen = {m: get_method(m) for m in names}
    for m in chosen.values():
        m.check_head_dim(lm.head_dim)
    CacheLayout.from_config(lm.model.config).check_context(asked[0], lm.name)
    check_engine_reads(chosen, asked[-1], n.engine_chunk)
    plan = Plan(s.mode, n.prompt_styles[0], tuple(names), tag or {}, s.sliding_layers, tuple(asked))
    units = _units(plan, _at_lengths(s, battery_contexts(cfg, lm, s), set(asked)), lambda q: exp.missing(names, **_keys(cfg, plan, q)))
    if not units:
        return exp.path
    torch.set_num_threads(cfg.threads)
    exp.start(sum(len(ms) for u in units for ms in u.payload.todo.values()), label)
    if cfg.cluster.present and settings is None:  # workers load the config's own model, not a weight-quantized lm
        run_units(cfg, units, exp.write_from_worker)
    else:
        for u in units:
            _run_unit(exp, lm, u.payload)
    return exp.close()


@dataclass(frozen=True)
class Plan:
    """What every unit of one battery run shares: its mode, prompt style, methods (reference first), the keys
    added to every row (``tag``), the sliding-layer rule and the lengths asked."""

    mode: str
    style: str
    methods: tuple[str, ...]
    tag: dict
    sliding: str
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class BatteryUnit:
    """One prefill's worth of a battery: ``prompts`` (single mode: one context's ``(ids, question)`` prompts at one
    length; multi_key: one ``(ids, questions)`` context) and ``todo``, each question's methods still missing."""

    plan: Plan
    prompts: list
    todo: dict


def _keys(cfg: Config, plan: Plan, q: Question) -> dict:
    """The keys of question ``q``'s rows (without ``method``)."""
    cell = cell_keys(cfg, Cell(plan.style, q.length, round(q.depth, 4), q.trial))
    return {**cell, **plan.tag, "context": q.context, "needle_key": q.key}


def _units(plan: Plan, contexts: list, missing: Callable[[Question], list[str]]) -> list[Unit]:
    """The units with a question still to ask: single mode one per (context, length), multi_key one per context."""
    if plan.mode == "single":
        groups = [[(ids, q) for ids, q in prompts if q.length == L] for prompts in contexts for L in plan.lengths]
        questions = [[q for _, q in g] for g in groups]
    else:
        groups, questions = [[c] for c in contexts], [qs for _, qs in contexts]
    units = []
    for g, qs in zip(groups, questions):
        todo = {q: ms for q in qs if (ms := missing(q))}
        if todo:
            size = sum(len(ids) for ids, _ in g) if plan.mode == "single" else len(g[0][0]) * len(todo)
            name = f"battery context {qs[0].context} at {sorted({q.length for q in qs})}"
            units.append(Unit(name, size, "niah.experiments.battery:battery_unit", BatteryUnit(plan, g, todo)))
    return units


def battery_unit(cfg: Config, lm, unit: BatteryUnit) -> list[dict]:
    """One unit's rows, computed on a cluster worker (keys and measurements; the driver adds the provenance)."""
    sink = Collect(cfg)
    _run_unit(sink, lm, unit)
    return sink.rows


def _run_unit(sink, lm, unit: BatteryUnit) -> None:
    """Ask one unit's questions; rows go to ``sink`` (an :class:`Experiment` or a :class:`Collect`)."""
    cfg, plan = sink.cfg, unit.plan
    n = cfg.niah
    how = Asking(
        {m: get_method(m) for m in plan.methods},
        plan.methods[0],
        lambda q: unit.todo.get(q, []),
        lambda q, method: sink.row(**_keys(cfg, plan, q), method=method),
        n.max_new_tokens,
        plan.sliding,
        n.engine_chunk,
    )
    if plan.mode == "single":
        _run_single_context(sink, lm, unit.prompts, how)
    else:
        _run_multi_key(sink, lm, unit.prompts, list(plan.lengths), how)


def _at_lengths(s: dict, contexts: list, lengths: set[int]) -> list:
    """``contexts`` (of :func:`battery_contexts`) with only the questions at ``lengths``."""
    if s.mode == "single":
        return [[(ids, q) for ids, q in prompts if q.length in lengths] for prompts in contexts]
    return [(ids, [q for q in qs if q.length in lengths]) for ids, qs in contexts]


@dataclass(frozen=True)
class Asking:
    """How a battery asks: its methods (reference first), which rows are still missing, and the row's keys."""

    methods: dict
    ref: str
    missing: Callable[[Question], list[str]]
    row: Callable[[Question, str], dict]
    max_new: int
    sliding: str
    engine_chunk: int


def _stretch(hay: TokenHaystack, c: int, contexts: int, length: int) -> TokenHaystack:
    """Context ``c``'s own stretch of the haystack (the stretches of ``contexts`` contexts are spread over it)."""
    start = hay.start_before(c * (len(hay.ids) - length) / max(contexts - 1, 1))
    return TokenHaystack(hay.ids[start:], [p - start for p in hay.starts if p >= start])


def _multi_key_contexts(lm, hay, s: dict, rng, kind: str, style: str) -> list[tuple[list[int], list[Question]]]:
    groups = [s.lengths] if s.nested else [[L] for L in s.lengths]
    return [
        build_context(lm.tokenizer, _stretch(hay, c, s.contexts, lengths[-1]), lengths, s.needles, rng, c, kind, style)
        for lengths in groups
        for c in range(s.contexts)
    ]


def _single_prompts(lm, hay, s: dict, rng, kind: str, style: str) -> list[list[tuple[list[int], Question]]]:
    """Per context, one (ids, question) prompt per needle: ``needles`` spread depths at every length, each prompt on the
    context's stretch of haystack with only its own needle."""
    out = []
    for c in range(s.contexts):
        sub, prompts = _stretch(hay, c, s.contexts, s.lengths[-1]), []
        for L in s.lengths:
            for k, d in enumerate(DEPTH_RULES[s.depths](s.needles)):
                ids, (q,) = build_context(lm.tokenizer, sub, [L], 1, rng, c, kind, style, depths=[d])
                prompts.append((ids, replace(q, index=k)))
        out.append(prompts)
    return out


def _run_single_context(sink, lm, prompts: list[tuple[list[int], Question]], how: Asking) -> None:
    """One context's single-needle prompts, in needle order, rows to ``sink`` (an :class:`Experiment` or a
    :class:`Collect`): the haystack before each needle is prefilled once (and cropped back to after each
    question), only the needle and the text after it per question."""
    chunk = sink.cfg.niah.prefill_chunk
    base, base_ids = None, []
    for ids, q in sorted(prompts, key=lambda p: (p[1].position, p[1].length)):
        todo = how.missing(q)
        if not todo or _too_long(sink, lm, [q], how):
            continue
        try:
            base, base_ids = extend_shared(lm.model, base, base_ids, SharedPrompt(ids, q.position), chunk)
            t0 = time.perf_counter()
            prefill(lm.model, ids[q.position :], base, chunk)
            sink.write(_ask_all(lm, context_states(base), [q], time.perf_counter() - t0, how))
            if croppable(base):
                base.crop(q.position - len(ids))
        except (torch.OutOfMemoryError, MemoryError) as err:
            sink.fail([how.row(q, m) for m in todo], "oom", err)
            base, base_ids = None, []


def _run_multi_key(sink, lm, contexts: list[tuple[list[int], list[Question]]], lengths: list[int], how: Asking) -> None:
    """Each multi-key context is prefilled once, in order; its state is taken out as the prefill passes each length."""
    missing, chunk = how.missing, sink.cfg.niah.prefill_chunk
    for ids, questions in contexts:
        cache, done, prefill_s = None, 0, 0.0
        for L in lengths:
            qs = [q for q in questions if q.length == L and missing(q)]
            if not qs or _too_long(sink, lm, qs, how):
                continue
            try:
                t0 = time.perf_counter()
                cache = prefill(lm.model, ids[done:L], cache, chunk)
                prefill_s, done = prefill_s + time.perf_counter() - t0, L
                sink.write(_ask_all(lm, context_states(cache), qs, prefill_s, how))
            except (torch.OutOfMemoryError, MemoryError) as err:
                sink.fail([how.row(q, m) for q in qs for m in missing(q)], "oom", err)
                break


def _too_long(sink, lm, qs: list[Question], how: Asking) -> bool:
    """Write too_long rows for ``qs`` (and say True) when their context, question and answer exceed the model's limit."""
    q = max(qs, key=lambda q: len(q.question_ids) + max(len(q.answer_ids), how.max_new))  # the longest of the prompts
    reason = too_long_reason(sink.cfg, lm, q.length + len(q.question_ids), len(q.answer_ids))
    if reason:
        sink.fail([how.row(q, m) for q in qs for m in how.missing(q)], "too_long", reason)
    return bool(reason)


def _ask_all(lm, states, qs: list[Question], prefill_s: float, how: Asking) -> list[dict]:
    """Store ``states`` once per method and ask every question of ``qs`` over it (over a clone where there are
    several; the reference first, whose answer logits the others' KL is taken against)."""
    methods, ref, missing, row, sliding = how.methods, how.ref, how.missing, how.row, how.sliding
    values, rows, ref_logsm = kv_entries(states), [], {}
    todo = {m for q in qs for m in missing(q)}
    for name in [ref, *(m for m in methods if m != ref and m in todo)]:
        t0 = time.perf_counter()
        stored = PackedCache.from_states(states, methods[name], sliding=sliding, engine_chunk=how.engine_chunk)
        quantize_s = time.perf_counter() - t0
        stored.dequantize_now()
        nbytes = stored.nbytes()
        for q in qs:
            cache = stored.clone() if len(qs) > 1 else stored
            ans = ask(lm.model, lm.tokenizer, cache, list(q.question_ids), list(q.answer_ids), how.max_new)
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


def run_needles(cfg: Config, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Notebook 03's needle rows: the battery where the config has a ``battery:`` section (on its cluster where it
    has one), else the grid."""
    from .grid import run_grid

    if cfg.battery.present:
        return run_battery(cfg, lm, out_path, progress)
    return run_grid(cfg, lm, out_path, progress)
