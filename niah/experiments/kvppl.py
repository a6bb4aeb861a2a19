"""Perplexity of held-out text read through each KV method's stored cache (seed claims S1-3 and S1-5).

Per window of ``context + continuation`` tokens from the evaluation split of pydoc (the text notebook 01 scores
weight schemes on, :mod:`niah.weightquant.data`): the context is prefilled once at full precision and every
method stores that same prefill in a :class:`~niah.kv.cache.PackedCache`, as in the needle protocol.  The
continuation is then one teacher-forced pass over the stored cache, which quantizes the continuation's own keys
and values as it stores them (every token for the formats without a residual window; KIVI keeps its newest 128
in full precision).  Its ``continuation - 1`` in-pass predictions are scored: each reads at least ``context``
quantized tokens.  Against the reference method (fp16) the paired figures are the perplexity ratio, with a
bootstrap interval over windows, and KL divergence and top-1 agreement of the next-token distributions.

Rows are keyed by (config, model, method, window); a killed run resumes where it stopped.  On a cluster
(:mod:`niah.cluster`) a window is one unit of work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..cluster import Unit, cluster_settings, run_units
from ..config import ConfigError
from ..kv.cache import PackedCache
from ..kv.layout import FULL, SLIDING
from ..kv.registry import get_method, with_modifier
from ..schema import section
from .base import Collect, Experiment
from .protocol import check_engine_reads, compare_logits, context_states, kv_entries, prefill, read_prompt

BOOTSTRAP = 2000  # resamples of the windows for the interval of perplexity_table


BREAKDOWN = ("keys", "values", "full", "sliding")  # the parts a breakdown row quantizes alone (KV method modifiers)


def kv_perplexity_settings(cfg: dict) -> dict:
    """The config's ``kv_perplexity`` section over its defaults (:data:`niah.schema.KV_PERPLEXITY`), the reference
    method first, then the listed methods, then the breakdown rows of ``breakdown_methods`` (default: every listed
    method): ``s["parts"]`` maps each breakdown row's method name to (the listed method, the part).  A listed method
    that already names a part of the same kind (a ``+keys`` method gets no ``+values`` row) gets no row for it, and a
    method that codes one attention layer type only gets no layer-type rows."""
    s = section(cfg, "kv_perplexity")
    if s["continuation"] < 2 or s["context"] < 1 or s["windows"] < 1:
        raise ConfigError(f"kv_perplexity needs context >= 1, continuation >= 2 and windows >= 1 tokens; got {s}")
    bad = [p for p in s["breakdown"] if p not in BREAKDOWN]
    if bad:
        raise ConfigError(f"unknown kv_perplexity.breakdown part(s) {bad}; choose among {', '.join(BREAKDOWN)}")
    ref = cfg["niah"]["reference"]
    listed = [m for m in s["methods"] if m != ref]
    of = listed if s["breakdown_methods"] is None else s["breakdown_methods"]
    if not set(of) <= set(listed):
        raise ConfigError(
            f"kv_perplexity.breakdown_methods {sorted(set(of) - set(listed))} are not in kv_perplexity.methods; list them there too"
        )
    s["parts"] = {}
    for m in of:
        layers = get_method(m).layers
        for part in s["breakdown"]:
            if part in ("full", "sliding") and not (layers.full and layers.sliding):
                continue  # it codes one layer type only (vLLM's presets): +full is the method, +sliding codes what it never does
            variant = with_modifier(m, part)
            if variant and variant not in listed:
                s["parts"][variant] = (m, part)
    s["methods"] = [ref, *listed, *s["parts"]]
    return s


@dataclass(frozen=True)
class Window:
    """One unit of perplexity through the cache: window ``index``, its ``ids`` (context then continuation), the
    ``methods`` to score on it (the reference first: its log-probs are the paired figures' reference) and
    ``todo``, those whose rows are still missing."""

    index: int
    ids: list[int]
    methods: tuple[str, ...]
    todo: tuple[str, ...]


def run_kv_perplexity(cfg: dict, lm, out_path: Path, progress: bool = True) -> Path:
    """Score every missing (method, window) row of the config's ``kv_perplexity`` section; return the table's path.
    With a cluster (:func:`~niah.cluster.cluster_settings`), each window is a unit on a Ray worker and this
    process writes their rows as they arrive."""
    from ..weightquant.data import split_text, token_windows
    from ..weightquant.settings import settings as wq_settings

    s = kv_perplexity_settings(cfg)
    tokens = s["context"] + s["continuation"]
    if tokens > lm.max_context:
        raise ConfigError(
            f"kv_perplexity: context + continuation = {tokens} tokens exceeds the model's limit of "
            f"{lm.max_context}; lower kv_perplexity.context or kv_perplexity.continuation"
        )
    for m in s["methods"]:
        get_method(m).check_head_dim(lm.head_dim)
    check_engine_reads({m: get_method(m) for m in s["methods"]}, s["context"], cfg["niah"]["engine_chunk"])
    exp = Experiment(cfg, "kv_perplexity", lm.name, out_path, progress)
    todo = {w: names for w in range(s["windows"]) if (names := exp.missing(s["methods"], window=w))}
    if not todo:
        return exp.path
    torch.set_num_threads(cfg["threads"])
    text = split_text("evaluation", wq_settings(cfg)["calibration_share"])
    windows = token_windows(lm.tokenizer, text, s["windows"], tokens)
    units = [Window(w, windows[w].tolist(), tuple(dict.fromkeys([s["methods"][0], *names])), tuple(names)) for w, names in todo.items()]
    exp.start(sum(len(u.todo) for u in units), "KV perplexity")
    cluster = cluster_settings(cfg)
    if cluster:
        work = [Unit(f"kv_perplexity window {u.index}", tokens * len(u.methods), "niah.experiments.kvppl:window_unit", u) for u in units]
        run_units(cfg, cluster, work, exp.write_from_worker)
    else:
        for u in units:
            _score_window(exp, lm, u)
    return exp.close()


def window_unit(cfg: dict, lm, unit: Window) -> list[dict]:
    """One window's rows, computed on a cluster worker (keys and measurements; the driver adds the provenance)."""
    sink = Collect(cfg)
    _score_window(sink, lm, unit)
    return sink.rows


@torch.no_grad()
def _score_window(sink, lm, unit: Window) -> None:
    """Prefill one window's context once and score each of its methods; rows go to ``sink`` (an
    :class:`~niah.experiments.base.Experiment` or a :class:`~niah.experiments.base.Collect`)."""
    cfg = sink.cfg
    s = kv_perplexity_settings(cfg)
    ids = unit.ids
    kv = context_states(prefill(lm.model, ids[: s["context"]], chunk=cfg["niah"]["prefill_chunk"]))
    ref_logsm = None
    for name in unit.methods:
        row, logsm = _score(lm, kv, get_method(name), ids[s["context"] :], cfg["niah"]["engine_chunk"])
        ref_logsm = logsm if ref_logsm is None else ref_logsm
        row["kl_vs_ref"], row["top1_vs_ref"] = compare_logits(ref_logsm, logsm)
        if name in unit.todo:
            keys = sink.row(method=name, window=unit.index, context=s["context"], continuation=s["continuation"])
            sink.write([{**keys, "status": "ok", **row}])


def _score(lm, kv, method, continuation: list[int], engine_chunk: int) -> tuple[dict, torch.Tensor]:
    """One teacher-forced pass of ``continuation`` over ``kv`` stored by ``method``: the row's numbers and the
    next-token log-softmax ``(len(continuation) - 1, vocab)``.  In the ``engine`` read mode the context is a cached
    prefix (a prefix-cache hit) and the continuation the new request's prompt, read as vLLM reads it."""
    stored = PackedCache.from_states(kv, method, engine_chunk=engine_chunk, fresh_prompt=False)
    values = kv_entries(kv)
    bits = 8 * stored.nbytes()["total"] / values
    ids = torch.tensor([continuation], device=next(lm.model.parameters()).device)
    logits = read_prompt(lm.model, stored, continuation).logits[0, :-1].float()
    logsm = torch.log_softmax(logits, dim=-1)
    nll = -logsm.gather(1, ids[0, 1:, None]).squeeze(1)
    fields = {"nll_sum": float(nll.sum()), "scored_tokens": int(nll.numel()), "bits_per_value": bits}
    by_type = {f"kv_bytes_{k}": v for k, v in stored.nbytes().items() if k in (FULL, SLIDING)}
    return {**fields, **by_type, "read_mode": method.read_mode, "layer_policy": method.layers.describe()}, logsm.cpu()


def perplexity_table(df: pd.DataFrame, ref: str = "fp16", bootstrap: int = BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Per method: perplexity over all scored tokens; ``ppl_vs_ref``, its ratio to the reference's perplexity on
    the same windows, with a 95% percentile-bootstrap interval (``ci_low``, ``ci_high``: windows resampled, one
    draw for both methods); mean KL and top-1 agreement against the reference; stored bits per value."""
    ok = df[df["status"] == "ok"]
    nll = ok.pivot_table(index="window", columns="method", values="nll_sum", aggfunc="sum")
    count = ok.pivot_table(index="window", columns="method", values="scored_tokens", aggfunc="sum")
    draws = np.random.default_rng(seed).integers(0, len(nll), size=(bootstrap, len(nll)))
    rows = []
    for method, part in ok.groupby("method", sort=False):
        row = {
            "method": method,
            "windows": len(part),
            "scored_tokens": int(part["scored_tokens"].sum()),
            "ppl": math.exp(part["nll_sum"].sum() / part["scored_tokens"].sum()),
            "ppl_vs_ref": float("nan"),
            "ci_low": float("nan"),
            "ci_high": float("nan"),
        }
        paired = nll[[method, ref]].notna().all(axis=1).to_numpy() if ref in nll else np.zeros(len(nll), bool)
        if paired.all():  # every window scored by both: bootstrap over windows
            row["ppl_vs_ref"] = math.exp(_log_ppl_ratio(nll, count, method, ref, np.arange(len(nll))))
            row["ci_low"], row["ci_high"] = np.exp(np.quantile(_log_ppl_ratio(nll, count, method, ref, draws), [0.025, 0.975]))
        row.update(
            {
                "kl_vs_ref": part["kl_vs_ref"].mean(),
                "top1_vs_ref": part["top1_vs_ref"].mean(),
                "bits_per_value": part["bits_per_value"].mean(),
            }
        )
        rows.append(row)
    return pd.DataFrame(rows).sort_values("bits_per_value", ascending=False).reset_index(drop=True)


def _log_ppl_ratio(nll: pd.DataFrame, count: pd.DataFrame, method: str, ref: str, windows: np.ndarray) -> np.ndarray:
    """``log(ppl_method / ppl_ref)`` over the windows at positions ``windows`` (``(..., n)``, repeats allowed)."""

    def log_ppl(m: str) -> np.ndarray:
        return nll[m].to_numpy()[windows].sum(-1) / count[m].to_numpy()[windows].sum(-1)

    return log_ppl(method) - log_ppl(ref)
