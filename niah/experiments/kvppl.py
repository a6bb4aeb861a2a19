"""Perplexity of held-out text read through each KV method's stored cache (seed claims S1-3 and S1-5).

Per window of ``context + continuation`` tokens from the evaluation split of pydoc (:mod:`niah.weightquant.data`),
the context is prefilled once at full precision and every method stores that same prefill in a
:class:`~niah.kv.cache.PackedCache`, as in the needle protocol.  The continuation is then one teacher-forced pass
over the stored cache, which quantizes the continuation's own keys and values as it stores them (KIVI keeps its
newest 128 in full precision); its ``continuation - 1`` predictions are scored, each reading at least ``context``
quantized tokens.  Against the reference method (fp16) the paired figures are the perplexity ratio, with a
bootstrap interval over windows, and KL divergence and top-1 agreement of the next-token distributions.

Rows are keyed by (config, model, method, window); a killed run resumes where it stopped.  On a cluster
(:mod:`niah.cluster`) a window is one unit of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import env
from ..cluster import Unit, run_units
from ..config import Config, ConfigError
from ..kv.cache import PackedCache
from ..kv.layout import FULL, SLIDING
from ..kv.registry import get_method
from ..kv.spec import CacheSpec
from ..weightquant.data import split_text, token_windows
from .base import Collect, Experiment, RowSink
from .protocol import compare_logits, context_states, kv_entries, prefill, read_prompt
from .specs import cache_spec, check_engine_reads


@dataclass(frozen=True)
class Window:
    """One unit of perplexity through the cache: window ``index``, its ``ids`` (context then continuation), the
    ``methods`` to score on it (the reference first: its log-probs are the paired figures' reference) and
    ``todo``, those whose rows are still missing."""

    index: int
    ids: list[int]
    methods: tuple[str, ...]
    todo: tuple[str, ...]


def run_kv_perplexity(cfg: Config, lm, out_path: Path, progress: bool = True) -> Path:
    """Score every missing (method, window) row of the config's ``kv_perplexity`` section; return the table's path.
    With a cluster (``cluster:``), each window is a unit on a Ray worker and this
    process writes their rows as they arrive."""

    s = cfg.kv_perplexity
    tokens = s.context + s.continuation
    if tokens > lm.max_context:
        raise ConfigError(
            f"kv_perplexity: context + continuation = {tokens} tokens exceeds the model's limit of "
            f"{lm.max_context}; lower kv_perplexity.context or kv_perplexity.continuation"
        )
    for m in s.methods:
        get_method(m).check_head_dim(lm.head_dim)
    check_engine_reads({m: cache_spec(cfg, m) for m in s.methods}, s.context)
    exp = Experiment(cfg, "kv_perplexity", lm.name, out_path, progress)
    todo = {w: names for w in range(s.windows) if (names := exp.missing(s.methods, window=w))}
    if not todo:
        return exp.path
    env.use_threads(cfg.threads)
    text = split_text("evaluation", cfg.weightquant.calibration_share)
    windows = token_windows(lm.tokenizer, text, s.windows, tokens)
    units = [
        Window(w, windows[w].tolist(), tuple(dict.fromkeys([s.methods[0], *names])), tuple(names))
        for w, names in todo.items()
    ]
    exp.start(sum(len(u.todo) for u in units), "KV perplexity")
    if cfg.cluster.present:
        work = [Unit(f"kv_perplexity window {u.index}", tokens * len(u.methods), window_unit, u) for u in units]
        run_units(cfg, work, exp.write_from_worker)
    else:
        for u in units:
            _score_window(exp, lm, u)
    return exp.close()


def window_unit(cfg: Config, lm, unit: Window) -> list[dict]:
    """One window's rows, computed on a cluster worker (keys and measurements; the driver adds the provenance)."""
    sink = Collect(cfg)
    _score_window(sink, lm, unit)
    return sink.rows


@torch.no_grad()
def _score_window(sink: RowSink, lm, unit: Window) -> None:
    """Prefill one window's context once and score each of its methods; rows go to ``sink``."""
    cfg = sink.cfg
    s = cfg.kv_perplexity
    ids = unit.ids
    kv = context_states(prefill(lm.model, ids[: s.context], chunk=cfg.niah.prefill_chunk))
    ref_logsm = None
    for name in unit.methods:
        row, logsm = _score(lm, kv, cache_spec(cfg, name, lm, fresh_prompt=False), ids[s.context :])
        ref_logsm = logsm if ref_logsm is None else ref_logsm
        row["kl_vs_ref"], row["top1_vs_ref"] = compare_logits(ref_logsm, logsm)
        if name in unit.todo:
            keys = sink.row(method=name, window=unit.index, context=s.context, continuation=s.continuation)
            sink.write([{**keys, "status": "ok", **row}])


def _score(lm, kv, spec: CacheSpec, continuation: list[int]) -> tuple[dict, torch.Tensor]:
    """One teacher-forced pass of ``continuation`` over ``kv`` stored as ``spec`` says: the row's numbers and the
    next-token log-softmax ``(len(continuation) - 1, vocab)``.  In the ``engine`` read mode the context is a cached
    prefix (a prefix-cache hit: ``spec.fresh_prompt`` False) and the continuation the new request's prompt, read as
    vLLM reads it."""
    method = spec.method
    stored = PackedCache.from_states(kv, spec)
    values = kv_entries(kv)
    bits = 8 * stored.nbytes()["total"] / values
    ids = torch.tensor([continuation], device=next(lm.model.parameters()).device)
    logits = read_prompt(lm.model, stored, continuation).logits[0, :-1].float()
    logsm = torch.log_softmax(logits, dim=-1)
    nll = -logsm.gather(1, ids[0, 1:, None]).squeeze(1)
    fields = {"nll_sum": float(nll.sum()), "scored_tokens": int(nll.numel()), "bits_per_value": bits}
    by_type = {f"kv_bytes_{k}": v for k, v in stored.nbytes().items() if k in (FULL, SLIDING)}
    return {**fields, **by_type, "read_mode": method.read_mode, "layer_policy": method.layers.describe()}, logsm.cpu()
