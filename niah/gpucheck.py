"""``make gpu-check``: the short script for the day a GPU is lent (``configs/gpu-check.yaml``, under 10 minutes).

Random-weight Qwen3.5-35B-A3B in bf16, made on the GPU; notebook 04's sweep at 4K and 16K with fp16, q8_0 and
``turboquant_k8v4``.  It writes ``papermill_runs/gpu-check/`` (``sweep_results.jsonl``, ``environment.json``,
``gpu_check.md``) and prints the table: peak memory, KV bytes per layer type, TTFT and TPOT, with the machine
named.  It also runs, once, the CUDA paths the CPU never takes and says that they ran: pynvml memory sampling
(each row's ``trace_source``), CUDA timing (``torch.cuda.synchronize`` after each decode step) and an accelerate
device map over every visible GPU (:func:`niah.models.spread_map`, built for the model's architecture on the meta
device).  ``--dry-run`` runs the same code on the CPU with a tiny model of the architecture
(:mod:`niah.dryrun`); only the CUDA calls are skipped.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from .config import ConfigError, load_config, validate
from .dryrun import dry_config
from .env import environment_record
from .experiments.sweep import run_sweep
from .models import ModelUnavailable, load_model, spread_map
from .notebook import save_json
from .report.summary import machine_line
from .rundir import RunDir

CONFIG = "gpu-check"


def check_config(dry_run: bool) -> dict:
    """The gpu-check config, or its dry-run rewrite (:func:`niah.dryrun.dry_config`)."""
    cfg = load_config(CONFIG)
    if dry_run:
        return validate(dry_config(cfg)[0], f"{CONFIG} (dry run)")
    if not torch.cuda.is_available():
        raise ModelUnavailable(
            f"make gpu-check needs an NVIDIA GPU and a CUDA build of torch; torch {torch.__version__} sees none here. "
            "`make gpu-check DRY_RUN=1` runs the same script on the CPU with a tiny model"
        )
    return cfg


def device_map_check(lm) -> str:
    """Build accelerate's device map of ``lm``'s architecture over every visible GPU (on the meta device: no
    memory) and say how many decoder layers each GPU would hold."""
    gpus = torch.cuda.device_count()
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(lm.model.config, dtype=next(lm.model.parameters()).dtype)
    # the model is loaded: free memory would not hold it twice
    where = spread_map(skeleton, gpus, budget=torch.cuda.get_device_properties(0).total_memory)
    layers = [f"model.layers.{i}" for i in range(skeleton.config.num_hidden_layers)]
    per_gpu = (
        pd.Series([where[max((k for k in where if _holds(k, name)), key=len)] for name in layers])
        .value_counts()
        .sort_index()
    )
    return f"device map over {gpus} GPU(s): " + ", ".join(
        f"GPU {i} holds {n} decoder layers" for i, n in per_gpu.items()
    )


def _holds(key: str, module: str) -> bool:
    """Whether the device-map entry ``key`` covers ``module`` (``""`` covers the whole model)."""
    return key == "" or module == key or module.startswith(key + ".")


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (method, length): TTFT, TPOT, peak memory and stored bytes per layer type, in MiB and ms."""
    ok = rows[rows["status"] == "ok"]
    mib = 2**20
    return pd.DataFrame(
        {
            "method": ok["method"],
            "length": ok["length"],
            "ttft_ms": (ok["ttft_s"] * 1e3).round(1),
            "tpot_ms": (ok["tpot_median_s"] * 1e3).round(2),
            "tpot_vs_fp16": ok["tpot_vs_ref"].round(3),
            "peak_memory_mib": (ok["peak_memory_bytes"] / mib).round(1),
            "kv_full_attention_mib": (ok["kv_bytes_full_attention"] / mib).round(2),
            "kv_sliding_attention_mib": (ok["kv_bytes_sliding_attention"] / mib).round(2),
            "linear_state_mib": (ok["linear_state_bytes"] / mib).round(2),
            "memory_read_by": ok["trace_source"],
        }
    ).reset_index(drop=True)


def gpu_check(dry_run: bool = False, run_root: Path | None = None) -> Path:
    """Run the check; return the path of its ``gpu_check.md``."""
    cfg = check_config(dry_run)
    run = RunDir(cfg, run_root / cfg.name if run_root else None)  # papermill_runs/gpu-check[-dry]/
    run.path.mkdir(parents=True, exist_ok=True)
    env = environment_record()
    save_json(env, run.path / "environment.json")
    t0 = time.perf_counter()
    lm = load_model(cfg.model, device=cfg.device)
    load_s = time.perf_counter() - t0
    cuda = str(cfg.device).startswith("cuda")
    paths = [device_map_check(lm) if cuda else "device map: skipped (CPU dry run)"]
    run_sweep(cfg, lm, run.file("sweep"))
    rows = run.rows("sweep")
    if not len(rows):
        raise ConfigError(f"the gpu check wrote no sweep rows to {run.file('sweep')}")
    table = summary_table(rows)
    readers = sorted(set(rows["trace_source"].dropna()))
    paths.append(f"memory sampling: {', '.join(readers)}")
    paths.append(
        "timing: torch.cuda.synchronize after every decode step" if cuda else "timing: CPU wall clock (dry run)"
    )
    failed = rows[rows["status"] != "ok"]
    text = "\n".join(
        [
            f"# gpu-check{' (dry run on the CPU: the numbers mean nothing)' if dry_run else ''}",
            "",
            f"Model {lm.name} ({cfg.model['dtype']}), made in {load_s:.0f} s; "
            f"machine: {machine_line(env)}; commit {env['git_commit']}.",
            "",
            *(f"- {p}" for p in paths),
            f"- rows not ok: {len(failed)}" + (f" ({', '.join(sorted(set(failed['status'])))})" if len(failed) else ""),
            "",
            table.to_markdown(index=False),
            "",
        ]
    )
    target = run.path / "gpu_check.md"
    target.write_text(text, encoding="utf-8")
    print(text)
    return target
