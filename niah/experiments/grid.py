"""Run a needle grid: (prompt style, length, depth, trial) cells x KV methods, resumable, one row per pair.

Work that need not be repeated is not: a cell is prefilled once for all its KV methods, and since
attention is causal the cache of the haystack before the first needle is shared by every cell.  Cells run
in order of that shared prefix; the prefix cache only grows, and each cell's own tokens are cropped off
again afterwards (a model with linear-attention layers, whose state cannot be cropped, prefills every cell).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from .. import env
from ..config import Config
from ..data.haystack import haystack_text, tokenize_haystack
from ..data.needles import NeedleSpec, make_trial
from ..data.prompts import CellPrompt, build_cell
from ..kv.layout import CacheLayout
from .base import Experiment, check_answer_room, too_long_reason
from .protocol import answer_fields, context_states, kv_entries, prefill, run_method
from .specs import cache_spec, check_engine_reads


@dataclass(frozen=True)
class Cell:
    style: str
    length: int
    depth: float
    trial: int


def cells(cfg: Config) -> list[Cell]:
    n = cfg.niah
    return [
        Cell(s, L, float(d), t) for s in n.prompt_styles for L in n.lengths for d in n.depths for t in range(n.trials)
    ]


def trial_rng(cfg: Config, cell: Cell) -> random.Random:
    """The seeded generator of one trial: same keys and values for every method, style and rerun."""
    return random.Random(f"{cfg.seed}/{cell.length}/{cell.depth}/{cell.trial}")


def cell_keys(cfg: Config, cell: Cell) -> dict:
    """The columns of a needle row that name its cell (besides the method)."""
    needle = cfg.niah.needle
    return {
        "prompt_style": cell.style,
        "length": cell.length,
        "depth": cell.depth,
        "trial": cell.trial,
        "needle_kind": needle["kind"],
        "needle_variant": needle["variant"],
    }


def run_grid(cfg: Config, loaded, out_path: Path | None = None, progress: bool = True) -> Path:
    """Run every missing (cell, method) row of ``cfg`` with the loaded model; return the table's path."""
    exp = Experiment(cfg, "needles", loaded.name, out_path, progress)
    n = cfg.niah
    methods = {m: cache_spec(cfg, m, loaded) for m in n.methods}
    for m in methods.values():
        m.method.check_head_dim(loaded.head_dim)
    CacheLayout.from_config(loaded.model.config).check_context(min(n.lengths), loaded.name)
    check_engine_reads(methods, max(n.lengths))

    def missing(cell):
        return exp.missing(methods, **cell_keys(cfg, cell))

    todo = [c for c in cells(cfg) if missing(c)]
    if not todo:
        return exp.path
    env.use_threads(cfg.threads)
    hay = tokenize_haystack(
        haystack_text(cfg.haystack, env.ROOT / cfg.haystack_folder), loaded.tokenizer, max(n.lengths)
    )
    spec = NeedleSpec(**n.needle)
    prompts = {
        c: build_cell(loaded.tokenizer, hay, c.length, c.depth, make_trial(spec, trial_rng(cfg, c)), c.style)
        for c in todo
    }
    check_answer_room(
        cfg, loaded, [(len(p.prefill_ids) + len(p.question_ids), len(p.answer_ids)) for p in prompts.values()]
    )
    exp.start(sum(len(missing(c)) for c in todo), "needle grid")
    for style in n.prompt_styles:
        base, base_ids = None, []
        for cell in sorted(
            (c for c in todo if c.style == style), key=lambda c: (prompts[c].shared_prefix, c.length, c.depth, c.trial)
        ):
            p = prompts[cell]
            unmeasured = [exp.row(**cell_keys(cfg, cell), method=m) for m in missing(cell)]
            reason = too_long_reason(cfg, loaded, len(p.prefill_ids) + len(p.question_ids), len(p.answer_ids))
            if reason:
                exp.fail(unmeasured, "too_long", reason)
                continue
            try:
                base, base_ids = extend_shared(loaded.model, base, base_ids, p, n.prefill_chunk)
                exp.write(_run_cell(exp, loaded, base, len(base_ids), p, methods, missing(cell), cell))
            except (torch.OutOfMemoryError, MemoryError) as err:
                exp.fail(unmeasured, "oom", err)
                base, base_ids = None, []
    return exp.close()


@dataclass(frozen=True)
class SharedPrompt:
    """What :func:`extend_shared` reads of a prompt: its ids, and how many leading ones it shares with the others."""

    prefill_ids: list[int]
    shared_prefix: int


def croppable(cache) -> bool:
    """Whether :meth:`~transformers.Cache.crop` can take tokens off ``cache`` again: every layer can, a
    linear-attention one only while it records its past (transformers >= 5.25 marks those layers croppable,
    then refuses the crop unless the recording was switched on; this repo does not record them)."""
    return cache.is_croppable and all(getattr(layer, "record_past", True) for layer in cache.layers)


def extend_shared(model, base, base_ids, p: CellPrompt | SharedPrompt, chunk: int):
    """Grow the shared-prefix cache to this cell's shared prefix (restart it if it is not a prefix, or if the
    last cell's tokens could not be cropped off: linear-attention states cannot be rolled back).  Its sliding
    layers record their past, so that :meth:`~transformers.Cache.crop` can take a cell's tokens off them."""
    want = p.prefill_ids[: p.shared_prefix]
    if base is None or want[: len(base_ids)] != base_ids or not croppable(base):
        base, base_ids = DynamicCache(config=model.config), []
        for layer in base.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.activate_past_recording()
    base = prefill(model, want[len(base_ids) :], base, chunk)
    return base, want


def _run_cell(
    exp: Experiment, loaded, base, shared: int, p: CellPrompt, methods, todo_methods, cell: Cell
) -> list[dict]:
    """Prefill the cell's own tokens on top of the shared cache, run the methods, crop back."""
    n = exp.cfg.niah
    t0 = time.perf_counter()
    prefill(loaded.model, p.prefill_ids[shared:], base, n.prefill_chunk)
    prefill_s = time.perf_counter() - t0
    try:
        kv = context_states(base)
        ref_name = n.reference
        order = [ref_name] + [m for m in todo_methods if m != ref_name]
        answers, rows = {}, []
        for name in order:
            ans, stored, quantize_s = run_method(
                loaded.model, loaded.tokenizer, kv, methods[name], p.question_ids, p.answer_ids, n.max_new_tokens
            )
            answers[name] = ans
            if name not in todo_methods:
                continue
            scored = answer_fields(
                ans,
                p.expected,
                answers[ref_name].answer_logsoftmax,
                stored,
                kv_entries(kv),
                methods[name].method,
                loaded.head_dim,
            )
            rows.append(
                {
                    **exp.row(**cell_keys(exp.cfg, cell), method=name),
                    "status": "ok",
                    "reason": "",
                    "context_tokens": len(p.prefill_ids),
                    "needle_position": p.needle_at / len(p.prefill_ids),
                    "answer_tokens": len(p.answer_ids),
                    **scored,
                    "prefill_s": prefill_s,
                    "shared_prefix_tokens": shared,
                    "quantize_s": quantize_s,
                }
            )
        return rows
    finally:
        # take this cell's own tokens off the shared prefix; a linear-attention state cannot be cropped, and
        # extend_shared then restarts the prefix for the next cell
        if len(p.prefill_ids) > shared and croppable(base):
            base.crop(shared - len(p.prefill_ids))
