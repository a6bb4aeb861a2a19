"""The stepped pressure sweep: context length from 1 token up to the longest step, per KV method.

One haystack context (the RULER intro, a needle right after it, then haystack) is prefilled incrementally, each
step's context a prefix of the next, so the sweep costs one prefill of the longest step.  Per step and method a row
holds KV bytes (measured and analytical); peak memory and a memory trace sampled at ``sweep.hz``; TTFT (the
cumulative chunked prefill plus the method's quantize time); TPOT, median and p90 over ``sweep.decode_steps`` greedy
steps on the real decode path (:mod:`niah.kv.attend`), and its ratio to the reference method paired round by round
(:func:`_paired_tpot`) with a bootstrap interval; retrieval of the needle and KL against the reference method.

Rows are keyed by (config, model, method, length); a killed sweep resumes where it stopped.  A step that runs out
of memory, or whose fp32 context would exceed ``sweep.memory_budget_gib``, is recorded with status ``oom`` and the
sweep goes on.  See docs/design-notes.md#niah.experiments.sweep.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import env
from ..cluster import Unit, run_units
from ..config import Config
from ..data.haystack import haystack_text, tokenize_haystack
from ..data.needles import NeedleSpec, make_trial, needle_text
from ..data.prompts import build_cell
from ..kv.cache import PackedCache, fused_decoding, warm_up
from ..kv.layout import FULL, SLIDING, CacheLayout
from ..kv.spec import CacheSpec
from ..models import load_model
from .base import Collect, Experiment, RowSink
from .protocol import ask, compare_logits, context_states, kv_entries, prefill
from .scoring import string_match_all
from .specs import cache_spec, check_engine_reads
from .telemetry import MemorySampler, model_cuda_devices


@torch.no_grad()
def _decode_step(model, cache, token: int) -> tuple[int, float]:
    """One greedy decode step after ``token``: the next token and the step's seconds."""
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True)
    nxt = int(out.logits[0, -1].argmax())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return nxt, time.perf_counter() - t0


def _greedy(model, cache, first_token: int, steps: int) -> list[int]:
    """``first_token`` and the ``steps`` greedy tokens after it (never stopping early)."""
    tokens = [first_token]
    for _ in range(steps):
        tokens.append(_decode_step(model, cache, tokens[-1])[0])
    return tokens


def _paired_tpot(lm, kv, methods: dict, first: dict[str, int], steps: int, ref: str) -> dict[str, dict]:
    """TPOT of every method in ``methods`` (name -> :class:`~niah.kv.spec.CacheSpec`, the reference ``ref`` among
    them) at the context ``kv``, from ``steps`` rounds of decode steps: each round runs one step of every method on
    its own freshly stored cache, from its token ``first[name]``, in an order rotated every round.  ``tpot_vs_ref``
    is the median over rounds of the method's step over the reference's step of the same round: the two ran a second
    or less apart, so a slow spell of a shared machine moves both (timed method after method, ratios at 16K moved by
    up to 1.4x between runs).  Returns per method ``tpot_median_s``, ``tpot_p90_s`` and ``tpot_vs_ref``."""
    caches = {n: PackedCache.from_states(kv, m) for n, m in methods.items()}
    for cache in caches.values():
        cache.end_prompt()  # decode steps read the stored form (engine mode: vLLM's decode kernel), not the raw prompt
    tokens, times, names = dict(first), {n: [] for n in methods}, list(methods)
    with fused_decoding(lm.model):
        for r in range(steps):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                tokens[n], seconds = _decode_step(lm.model, caches[n], tokens[n])
                times[n].append(seconds)
    out = {}
    for n, ts in times.items():
        ratios = np.array([t / t_ref for t, t_ref in zip(ts, times[ref])])
        low, high = _median_interval(ratios)
        out[n] = {
            "tpot_median_s": statistics.median(ts),
            "tpot_p90_s": _percentile(ts, 0.9),
            "tpot_vs_ref": float(np.median(ratios)),
            "tpot_vs_ref_low": low,
            "tpot_vs_ref_high": high,
        }
    return out


def _median_interval(x: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``x`` (the spread of a paired ratio over rounds)."""
    medians = np.median(x[np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))], axis=1)
    return float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_sweep(cfg: Config, lm, out_path: Path, progress: bool = True) -> Path:
    """Run every missing (method, length) row of the config's sweep; return the table's path.  With a cluster
    (``cluster:``), each (length, method) is a unit on a Ray worker, which prefills
    step by step up to its length and pairs its TPOT with the reference's; this process writes the rows."""
    s = cfg.sweep
    exp = Experiment(cfg, "sweep", lm.name, out_path, progress)
    lengths = sorted(s.lengths)
    CacheLayout.from_config(lm.model.config).check_context(lengths[0], lm.name)
    check_engine_reads({m: cache_spec(cfg, m) for m in s.methods}, lengths[-1])
    todo = {L: names for L in lengths if (names := exp.missing(s.methods, length=L))}
    if not todo:
        return exp.path
    exp.start(sum(map(len, todo.values())), "pressure sweep")
    if cfg.cluster.present:
        units = [Unit(f"sweep {m} at {L}", L, sweep_unit, {L: [m]}) for L, names in todo.items() for m in names]
        run_units(cfg, units, exp.write_from_worker)
    else:
        env.use_threads(cfg.threads)
        _run_steps(exp, lm, todo)
    return exp.close()


def sweep_unit(cfg: Config, lm, todo: dict[int, list[str]]) -> list[dict]:
    """One unit's rows, computed on a cluster worker (keys and measurements; the driver adds the provenance)."""
    sink = Collect(cfg)
    _run_steps(sink, lm, todo)
    return sink.rows


def _run_steps(sink: RowSink, lm, todo: dict[int, list[str]]) -> None:
    """Prefill the sweep's context step by step up to the longest length in ``todo`` (length -> methods still
    missing) and measure those methods, with the reference, at their lengths; rows go to ``sink``."""
    cfg = sink.cfg
    s = cfg.sweep
    ref = cfg.niah.reference
    longest = max(s.lengths)  # every step's context is a prefix of the longest step's, on every worker
    lengths = [L for L in sorted(s.lengths) if L <= max(todo)]
    # the real decode path: every step reads the whole stored cache, chunk by chunk
    decode = {"keep_dequantized": False, "fused_decode": True}
    methods = {
        m: cache_spec(cfg, m, lm, **decode) for m in dict.fromkeys([ref, *(m for ms in todo.values() for m in ms)])
    }
    hay = tokenize_haystack(haystack_text(cfg.haystack, env.ROOT / cfg.haystack_folder), lm.tokenizer, longest)
    trial = make_trial(NeedleSpec(**{**cfg.niah.needle, "variant": "single"}), random.Random(f"{cfg.seed}/sweep"))
    cell = build_cell(lm.tokenizer, hay, longest, 0.0, trial, "completion")
    probe_from = cell.needle_at + len(
        lm.tokenizer.encode(needle_text(trial.kind, *trial.needles[0]), add_special_tokens=False)
    )
    cuda = str(cfg.device).startswith("cuda")
    for m in methods.values():  # compile the fused kernels before anything is timed
        warm_up(m.method, lm.model.config.num_key_value_heads, lm.head_dim, device=next(lm.model.parameters()).device)
    layout = CacheLayout.from_config(lm.model.config)
    cache, done_tokens, ttft = None, 0, 0.0
    for L in lengths:
        names = todo.get(L, [])
        budget = s.memory_budget_gib
        fp32_bytes = 4 * sum(layout.kv_values(L).values())  # sliding layers keep only their window
        if budget is not None and fp32_bytes > budget * 2**30:
            reason = f"fp32 context of {fp32_bytes / 2**30:.2f} GiB exceeds the memory budget of {budget} GiB"
            sink.fail([sink.row(method=m, length=L) for m in names], "oom", reason)
            continue
        try:
            t0 = time.perf_counter()
            cache = prefill(lm.model, cell.prefill_ids[done_tokens:L], cache, cfg.niah.prefill_chunk)
            ttft += time.perf_counter() - t0
            done_tokens = L
        except (torch.OutOfMemoryError, MemoryError) as err:
            sink.fail([sink.row(method=m, length=L) for m in names], "oom", err)
            break
        if names:
            step = {n: methods[n] for n in [ref, *names]}
            sink.write(_step_rows(sink, lm, context_states(cache), L, step, names, cell, L >= probe_from, ttft, cuda))


def _step_rows(
    sink: RowSink, lm, kv, L: int, methods: dict, names: list[str], cell, probe: bool, ttft: float, cuda: bool
) -> list[dict]:
    """The rows of ``names`` at the step of length ``L``, whose context is ``kv``: each of ``methods`` (the reference
    first) is stored, probed and decoded, then all are decoded together for the paired TPOT."""
    s = sink.cfg.sweep
    ref = next(iter(methods))
    answers, firsts, rows = {}, {}, {}
    for name, method in methods.items():
        row = sink.row(method=name, length=L)
        try:
            row.update(_measure(lm, kv, method, cell, probe, s, cuda))
        except (torch.OutOfMemoryError, MemoryError) as err:
            if name in names:
                sink.fail([row], "oom", err)
            continue
        answers[name], firsts[name] = row.pop("_answer"), row.pop("_first")
        if probe and ref in answers:
            row["kl_vs_ref"], row["top1_vs_ref"] = compare_logits(
                answers[ref].answer_logsoftmax, answers[name].answer_logsoftmax
            )
            row["score"] = string_match_all(row["generated"], cell.expected)
        row["ttft_s"] = ttft + row["quantize_s"]
        row["prefill_s"] = ttft
        rows[name] = row
    try:
        paired = _paired_tpot(lm, kv, {n: methods[n] for n in rows}, firsts, s.decode_steps, ref) if ref in rows else {}
    except (torch.OutOfMemoryError, MemoryError) as err:
        reason = f"paired decode of {len(rows)} caches at once: {str(err)[:250]}"
        rows = {n: {**row, "status": "oom", "reason": reason} for n, row in rows.items()}
        paired = {}
    return [{**rows[name], **paired.get(name, {})} for name in rows if name in names]


def _measure(lm, kv, spec: CacheSpec, cell, probe: bool, s: dict, cuda: bool) -> dict:
    """Store, probe and decode one step for one method, with its memory trace; the numbers of one sweep row but
    TPOT (:func:`_paired_tpot`), and its first decode token (``_first``)."""
    gpus = model_cuda_devices(lm.model)  # several when the model is spread over GPUs: memory is their sum
    for i in gpus:
        torch.cuda.reset_peak_memory_stats(i)
    sampler = MemorySampler(hz=s.hz, source="cuda" if cuda else "rss", devices=gpus).start()
    try:
        t0 = time.perf_counter()
        stored = PackedCache.from_states(kv, spec)
        quantize_s = time.perf_counter() - t0
        nbytes = stored.nbytes()
        with fused_decoding(lm.model):
            answer = ask(lm.model, lm.tokenizer, stored, cell.question_ids, cell.answer_ids, 1)
            first = (lm.tokenizer.encode(answer.text, add_special_tokens=False)[:1] or [lm.tokenizer.eos_token_id])[0]
            tokens = _greedy(lm.model, stored, first, s.decode_steps)
    finally:
        sampler.stop()
    values = kv_entries(kv)
    return {
        "status": "ok",
        "reason": "",
        "_answer": answer,
        "_first": first,
        "probe": probe,
        "kv_bytes": nbytes["total"],
        "kv_bytes_packed": nbytes["packed"],
        "kv_bytes_residual": nbytes["residual"],
        "kv_bytes_full_attention": nbytes[FULL],
        "kv_bytes_sliding_attention": nbytes[SLIDING],
        "linear_state_bytes": nbytes["linear_state"],
        "kv_bytes_analytical": spec.method.analytical_bits(lm.head_dim) * values / 8,
        "bits_per_value": 8 * nbytes["total"] / values,
        "quantize_s": quantize_s,
        "decode_steps": s.decode_steps,
        "peak_memory_bytes": sum(torch.cuda.max_memory_allocated(i) for i in gpus) if cuda else sampler.peak,
        "memory_source": "cuda max_memory_allocated" if cuda else "process RSS",
        "trace_source": sampler.reader,
        "trace_t": [round(t, 4) for t in sampler.times],
        "trace_bytes": sampler.values,
        "generated": lm.tokenizer.decode(tokens, skip_special_tokens=True),
    }


def first_request_ttft(cfg: Config, target: int, warmup: int = 0) -> dict:
    """In this process: load the model, optionally run a ``warmup``-token request, then time a ``target``-token prefill.

    Call it in a fresh process (see :func:`cold_vs_warm`): "cold" means the first request after loading.
    """
    env.use_threads(cfg.threads)
    lm = load_model(cfg.model, device=cfg.device)
    ids = tokenize_haystack(haystack_text(cfg.haystack, env.ROOT / cfg.haystack_folder), lm.tokenizer, target).ids
    out = {"target": target, "warmup": warmup}
    if warmup:
        t0 = time.perf_counter()
        prefill(lm.model, ids[:warmup], chunk=cfg.niah.prefill_chunk)
        out["warmup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    prefill(lm.model, ids[-target:], chunk=cfg.niah.prefill_chunk)
    out["ttft_s"] = time.perf_counter() - t0
    return out


def cold_vs_warm(cfg: Config, target: int, warmup: int, repeats: int = 1) -> dict:
    """TTFT of the first ``target``-token request in a fresh process, without and with a ``warmup``-token request
    first, ``repeats`` times each (cold and warm alternate, so a slow spell of the machine hits both).

    Returns ``{"target", "warmup", "cold_s": [...], "warm_s": [...], "reduction"}``, the reduction of the medians."""
    runs = {"target": target, "warmup": warmup, "cold_s": [], "warm_s": []}
    for _ in range(repeats):
        for label, w in (("cold", 0), ("warm", warmup)):
            code = (
                "import json, sys; from niah.config import validate; from niah.experiments.sweep import "
                "first_request_ttft; "
                f"print(json.dumps(first_request_ttft(validate(json.load(sys.stdin)), {target}, {w})))"
            )
            proc = subprocess.run(
                [sys.executable, "-c", code], input=json.dumps(cfg.raw), capture_output=True, text=True, cwd=env.ROOT
            )
            if proc.returncode:
                err = proc.stderr.strip()
                raise RuntimeError(f"the {label} TTFT probe failed: {err.splitlines()[-1] if err else proc.returncode}")
            runs[f"{label}_s"].append(json.loads(proc.stdout.strip().splitlines()[-1])["ttft_s"])
    runs["reduction"] = 1 - statistics.median(runs["warm_s"]) / statistics.median(runs["cold_s"])
    return runs
