"""The needle battery: many scored questions per (method, length) for the price of a few prefills.

This module runs the battery; :mod:`niah.data.placement` builds its contexts and questions in token space.  Two
designs (``battery.mode``; what each measured is in docs/protocol.md):

* ``single`` (one needle per prompt): the prompts of one context share their haystack up to the needle, prefilled
  once (:func:`~niah.experiments.grid.extend_shared`); each question pays only for its needle and the text after it.
* ``multi_key`` (RULER's multi-key needles): one context holds the needles of every length; attention is causal, so
  it is prefilled once, in order, its state taken out at each length (:func:`~.protocol.context_states`).

Every method stores a prefill's state once and each question runs over it.  A unit of work is one prefill's worth
(:class:`BatteryUnit`), run here or on a Ray worker.  Rows go to the needle table with the grid's columns (``depth``
is the nominal depth, so the depth x length heatmap is a view of the battery), plus ``context`` and ``needle_key``;
a killed run resumes where it stopped.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..cluster import Unit, run_units
from ..config import Config
from ..data.haystack import HaystackTooShort, haystack_text, tokenize_haystack
from ..data.placement import DEPTH_RULES, Question, multi_key_contexts, single_prompts
from ..kv.cache import PackedCache
from ..kv.layout import CacheLayout
from ..schema import Battery, ConfigError
from .base import Collect, Experiment, RowSink, check_answer_room, too_long_reason
from .grid import Cell, SharedPrompt, cell_keys, croppable, extend_shared, run_grid
from .protocol import answer_fields, ask, context_states, kv_entries, prefill
from .specs import cache_spec, check_engine_reads


def battery_contexts(cfg: Config, lm, s: Battery | None = None) -> list:
    """The battery's contexts, built from the config's seed: in ``single`` mode, per context a list of
    ``(ids, question)`` prompts; in ``multi_key`` mode, ``(ids, questions)`` per context."""
    s = s or cfg.battery
    n = cfg.niah
    style, kind = n.prompt_styles[0], n.needle["kind"]
    need = s.lengths[-1] * s.contexts  # each context its own stretch of text at the longest length
    try:
        hay = tokenize_haystack(
            haystack_text(cfg.haystack, env.ROOT / cfg.haystack_folder), lm.tokenizer, need, repeat=False
        )
    except HaystackTooShort as err:
        raise ConfigError(
            f"{err} for the battery's {s.contexts} contexts of {s.lengths[-1]} tokens ({lm.name}'s tokenizer); "
            "contexts cut from a repeated text would be the same text, and count as independent questions. "
            "Ask fewer battery.contexts (and more battery.needles), shorter battery.lengths, "
            "or a larger haystack (haystack: folder)"
        ) from None
    rng = random.Random(f"{cfg.seed}/battery")
    if s.mode == "single":
        depths = DEPTH_RULES[s.depths](s.needles)
        return single_prompts(lm.tokenizer, hay, s.contexts, s.lengths, depths, rng, kind, style)
    groups = [s.lengths] if s.nested else [[L] for L in s.lengths]
    return multi_key_contexts(lm.tokenizer, hay, s.contexts, groups, s.needles, rng, kind, style)


def question_prompts(cfg: Config, lm) -> list[tuple[list[int], Question]]:
    """Every battery question with the ids of its own context (``multi_key``: its context's first ``length`` ids)."""
    return _flat(cfg.battery, battery_contexts(cfg, lm))


def _flat(s: Battery, contexts: list) -> list[tuple[list[int], Question]]:
    if s.mode == "single":
        return [p for prompts in contexts for p in prompts]
    return [(ids[: q.length], q) for ids, qs in contexts for q in qs]


def run_battery(cfg: Config, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Run every missing (question, method) row of the config's battery; return the results table's path.  With a
    ``cluster:`` section the units go to Ray workers, and this process writes their rows as they arrive.  Notebook
    01's weights x KV cells take the same steps (:func:`niah.weightquant.needle.run_needles`)."""
    exp = Experiment(cfg, "needles", lm.name, out_path, progress)  # the results table, and the rows it holds
    plan = battery_plan(cfg, lm, cfg.battery)  # the methods and lengths asked, checked against the model
    contexts = battery_contexts(cfg, lm)  # the seeded contexts and their questions
    return ask_battery(exp, lm, plan, contexts, "needle battery", cluster=cfg.cluster.present)


def battery_plan(
    cfg: Config,
    lm,
    s: Battery,
    methods: list[str] | None = None,
    lengths: list[int] | None = None,
    tag: dict | None = None,
) -> Plan:
    """What a run of battery ``s`` asks: its questions at ``lengths`` (default: all of ``s``'s) through ``methods``
    (default: the battery's; the reference always first), with ``tag`` (e.g. ``{"weights": ...}``) added to every
    row's keys.  Raises where the model cannot hold a method's cache or the context."""
    n = cfg.niah
    asked = sorted(lengths or s.lengths)
    names = list(dict.fromkeys([n.reference, *(methods or s.methods)]))
    chosen = {m: cache_spec(cfg, m) for m in names}
    for m in chosen.values():
        m.method.check_head_dim(lm.head_dim)
    CacheLayout.from_config(lm.model.config).check_context(asked[0], lm.name)
    check_engine_reads(chosen, asked[-1])
    return Plan(s.mode, n.prompt_styles[0], tuple(names), tag or {}, s.sliding_layers, tuple(asked), s.method_lengths)


def ask_battery(exp: Experiment, lm, plan: Plan, contexts: list, label: str, cluster: bool = False) -> Path:
    """Ask every question of ``contexts`` (of :func:`battery_contexts`) that ``plan`` asks and ``exp`` holds no row
    of, one unit per prefill, under the progress bar's ``label``; with ``cluster``, on Ray workers, which load the
    config's own model (so never for a weight-quantized ``lm``).  Returns the results table's path."""
    units = _units(exp, plan, contexts)
    if not units:
        return exp.path
    check_answer_room(
        exp.cfg, lm, [(q.length + len(q.question_ids), len(q.answer_ids)) for u in units for q in u.payload.todo]
    )
    env.use_threads(exp.cfg.threads)
    exp.start(sum(len(ms) for u in units for ms in u.payload.todo.values()), label)
    if cluster:
        run_units(exp.cfg, units, exp.write_from_worker)
    else:
        for u in units:
            _run_unit(exp, lm, u.payload)
    return exp.close()


@dataclass(frozen=True)
class Plan:
    """What every unit of one battery run shares: its mode, prompt style, methods (reference first), the keys
    added to every row (``tag``), the sliding-layer rule, the lengths asked and the methods asked at some of them
    only (``battery.method_lengths``)."""

    mode: str
    style: str
    methods: tuple[str, ...]
    tag: dict
    sliding: str
    lengths: tuple[int, ...]
    method_lengths: dict

    def methods_at(self, length: int) -> list[str]:
        return [m for m in self.methods if length in self.method_lengths.get(m, [length])]


@dataclass(frozen=True)
class BatteryUnit:
    """One prefill's worth of a battery: ``prompts`` (single mode: one context's ``(ids, question)`` prompts at one
    length; multi_key: one ``(ids, questions)`` context) and ``todo``, each question's methods still missing."""

    plan: Plan
    prompts: list
    todo: dict

    def missing(self, q: Question) -> list[str]:
        return self.todo.get(q, [])


def _keys(cfg: Config, plan: Plan, q: Question) -> dict:
    """The keys of question ``q``'s rows (without ``method``)."""
    cell = cell_keys(cfg, Cell(plan.style, q.length, round(q.depth, 4), q.trial))
    return {**cell, **plan.tag, "context": q.context, "needle_key": q.key}


def _row(sink: RowSink, plan: Plan, q: Question, method: str) -> dict:
    """The start of question ``q``'s row for ``method``: its keys (and in this process its provenance)."""
    return sink.row(**_keys(sink.cfg, plan, q), method=method)


def _units(exp: Experiment, plan: Plan, contexts: list) -> list[Unit]:
    """The units with a question still to ask: single mode one per (context, length), multi_key one per context."""
    if plan.mode == "single":
        groups = [[(ids, q) for ids, q in prompts if q.length == L] for prompts in contexts for L in plan.lengths]
        questions = [[q for _, q in g] for g in groups]
    else:
        groups = [[(ids, [q for q in qs if q.length in plan.lengths])] for ids, qs in contexts]
        questions = [g[0][1] for g in groups]
    units = []
    for g, qs in zip(groups, questions):
        todo = {q: ms for q in qs if (ms := exp.missing(plan.methods_at(q.length), **_keys(exp.cfg, plan, q)))}
        if todo:
            size = sum(len(ids) for ids, _ in g) if plan.mode == "single" else len(g[0][0]) * len(todo)
            name = f"battery context {qs[0].context} at {sorted({q.length for q in qs})}"
            units.append(Unit(name, size, battery_unit, BatteryUnit(plan, g, todo)))
    return units


def battery_unit(cfg: Config, lm, unit: BatteryUnit) -> list[dict]:
    """One unit's rows, computed on a cluster worker (keys and measurements; the driver adds the provenance)."""
    sink = Collect(cfg)
    _run_unit(sink, lm, unit)
    return sink.rows


def _run_unit(sink: RowSink, lm, unit: BatteryUnit) -> None:
    """Ask one unit's questions; rows go to ``sink``."""
    if unit.plan.mode == "single":
        _run_single_context(sink, lm, unit)
    else:
        _run_multi_key(sink, lm, unit)


def _run_single_context(sink: RowSink, lm, unit: BatteryUnit) -> None:
    """One context's single-needle prompts at one length, in needle order: the haystack before each needle is
    prefilled once (and cropped back to after each question), only the needle and the text after it per question."""
    chunk = sink.cfg.niah.prefill_chunk
    base, base_ids = None, []
    for ids, q in sorted(unit.prompts, key=lambda p: (p[1].position, p[1].length)):
        if not unit.missing(q) or _too_long(sink, lm, unit, [q]):
            continue
        try:
            base, base_ids = extend_shared(lm.model, base, base_ids, SharedPrompt(ids, q.position), chunk)
            t0 = time.perf_counter()
            prefill(lm.model, ids[q.position :], base, chunk)
            sink.write(_ask_all(sink, lm, unit, context_states(base), [q], time.perf_counter() - t0))
            if croppable(base):  # else (linear-attention state) extend_shared restarts the prefix for the next one
                base.crop(q.position - len(ids))
        except (torch.OutOfMemoryError, MemoryError) as err:
            sink.fail(_unasked(sink, unit, [q]), "oom", err)
            base, base_ids = None, []


def _run_multi_key(sink: RowSink, lm, unit: BatteryUnit) -> None:
    """A multi-key context is prefilled once, in order; its state is taken out as the prefill passes each length."""
    chunk = sink.cfg.niah.prefill_chunk
    for ids, questions in unit.prompts:
        cache, done, prefill_s = None, 0, 0.0
        for L in unit.plan.lengths:
            qs = [q for q in questions if q.length == L and unit.missing(q)]
            if not qs or _too_long(sink, lm, unit, qs):
                continue
            try:
                t0 = time.perf_counter()
                cache = prefill(lm.model, ids[done:L], cache, chunk)
                prefill_s, done = prefill_s + time.perf_counter() - t0, L
                sink.write(_ask_all(sink, lm, unit, context_states(cache), qs, prefill_s))
            except (torch.OutOfMemoryError, MemoryError) as err:
                sink.fail(_unasked(sink, unit, qs), "oom", err)
                break


def _too_long(sink: RowSink, lm, unit: BatteryUnit, qs: list[Question]) -> bool:
    """Write too_long rows for ``qs`` (and say True) when their context, question and answer exceed the model's
    limit."""
    max_new = sink.cfg.niah.max_new_tokens
    q = max(qs, key=lambda q: len(q.question_ids) + max(len(q.answer_ids), max_new))  # the longest of the prompts
    reason = too_long_reason(sink.cfg, lm, q.length + len(q.question_ids), len(q.answer_ids))
    if reason:
        sink.fail(_unasked(sink, unit, qs), "too_long", reason)
    return bool(reason)


def _unasked(sink: RowSink, unit: BatteryUnit, qs: list[Question]) -> list[dict]:
    """The rows still missing for ``qs``, to be written as not measured."""
    return [_row(sink, unit.plan, q, m) for q in qs for m in unit.missing(q)]


def _ask_all(sink: RowSink, lm, unit: BatteryUnit, states, qs: list[Question], prefill_s: float) -> list[dict]:
    """Store ``states`` once per method and ask every question of ``qs`` over it (over a clone where there are
    several; the reference first, whose answer logits the others' KL is taken against)."""
    plan, missing, max_new = unit.plan, unit.missing, sink.cfg.niah.max_new_tokens
    methods = {m: cache_spec(sink.cfg, m, lm, sliding=plan.sliding) for m in plan.methods}  # name -> CacheSpec
    ref = plan.methods[0]
    values, rows, ref_logsm = kv_entries(states), [], {}
    todo = {m for q in qs for m in missing(q)}
    for name in [ref, *(m for m in methods if m != ref and m in todo)]:
        t0 = time.perf_counter()
        stored = PackedCache.from_states(states, methods[name])
        quantize_s = time.perf_counter() - t0
        stored.dequantize_now()
        nbytes = stored.nbytes()
        for q in qs:
            cache = stored.clone() if len(qs) > 1 else stored
            ans = ask(lm.model, lm.tokenizer, cache, list(q.question_ids), list(q.answer_ids), max_new)
            if name == ref:
                ref_logsm[q] = ans.answer_logsoftmax
            if name not in missing(q):
                continue
            rows.append(
                {
                    **_row(sink, plan, q, name),
                    "status": "ok",
                    "reason": "",
                    "context_tokens": q.length,
                    "needle_position": q.position / q.length,
                    "answer_tokens": len(q.answer_ids),
                    **answer_fields(ans, [q.value], ref_logsm[q], nbytes, values, methods[name].method, lm.head_dim),
                    "sliding_layers": methods[name].sliding,
                    "prefill_s": prefill_s,
                    "quantize_s": quantize_s,
                }
            )
    return rows


def run_needles(cfg: Config, lm, out_path: Path | None = None, progress: bool = True) -> Path:
    """Notebook 03's needle rows: the battery where the config has a ``battery:`` section (on its cluster where it
    has one), else the grid."""
    if cfg.battery.present:
        return run_battery(cfg, lm, out_path, progress)
    return run_grid(cfg, lm, out_path, progress)
