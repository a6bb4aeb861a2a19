"""Two speed ratios of the Ray path (:mod:`niah.cluster`), each measured in one run: ``python -m niah bench cluster``.

* :func:`workers_vs_threads`: a slice of the cpu battery, once in this process with 2 torch threads and once on a
  local cluster of 2 workers with 1 thread each (each worker loads the model on its first unit; that load is
  counted, and the cost of starting the cluster and loading the models is timed apart).
* :func:`unit_overhead`: the cost of sending a unit, from ``units`` units that do nothing, against the mean unit
  of the smoke battery in one process.

Both start their own local Ray cluster and need the optional extra (``make setup-ray``).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ..cluster import Pool, Unit
from ..config import Config, load_config
from ..models import load_model
from .battery import battery_contexts, run_battery

LOCAL = {"engine": "ray", "address": None, "workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1}


def noop(cfg: Config, lm, payload) -> list[dict]:
    """A unit that computes nothing and returns its payload as one row (what :func:`unit_overhead` sends)."""
    return [{"payload": payload}]


def _battery_slice(cfg: Config, length: int, contexts: int, needles: int, methods: list[str]) -> Config:
    return cfg.updated("battery", lengths=[length], contexts=contexts, needles=needles, methods=methods)


def _one_process(cfg: Config) -> Config:
    """``cfg`` run in this process even where ``--cluster`` (NIAH_CLUSTER) asks for a cluster: the baseline."""
    return replace(cfg, cluster=replace(cfg.cluster, present=False))


def _timed_battery(cfg: Config, lm, folder: Path, name: str) -> float:
    t0 = time.perf_counter()
    run_battery(cfg, lm, folder / f"{name}.jsonl", progress=False)
    return time.perf_counter() - t0


def workers_vs_threads(
    config: str = "cpu", length: int = 4096, contexts: int = 4, needles: int = 2, methods=("fp16", "q8_0")
) -> dict:
    """Seconds for the same battery slice (``contexts`` units of ``needles`` questions at ``length``, ``methods``)
    in one process with 2 threads and on 2 Ray workers with 1 thread each; ``speedup`` is their ratio."""
    cfg = _battery_slice(load_config(config).updated("", threads=2), length, contexts, needles, list(methods))
    lm = load_model(cfg.model, device=cfg.device)
    with tempfile.TemporaryDirectory() as tmp:
        one = _timed_battery(_one_process(cfg), lm, Path(tmp), "one")
        many = _timed_battery(cfg.updated("cluster", **LOCAL), lm, Path(tmp), "many")
    start = _startup(cfg.updated("cluster", **LOCAL))
    return {
        "slice": f"{config} battery, {contexts} contexts x {needles} questions at {length}, methods {list(methods)}",
        "one_process_2_threads_s": one,
        "two_workers_1_thread_s": many,
        "speedup": one / many,
        "cluster_startup_s": start,
        "speedup_after_startup": one / (many - start),
    }


def _startup(cfg: Config) -> float:
    """Seconds to start a local cluster of :data:`LOCAL`'s workers and load the model in each (one empty unit each)."""
    t0 = time.perf_counter()
    with Pool(cfg) as pool:
        list(pool.run([Unit(f"warm-up {i}", 1, noop, None) for i in range(LOCAL["workers"])]))
        return time.perf_counter() - t0


def unit_overhead(units: int = 200) -> dict:
    """Seconds per unit of sending ``units`` empty units to 2 warm workers on the smoke config, against the mean
    unit of the smoke battery run in one process (``ratio``: overhead / unit)."""
    cfg = load_config("smoke")
    lm = load_model(cfg.model)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_battery(_one_process(cfg), lm, Path(tmp) / "one.jsonl", progress=False)
        battery_s = time.perf_counter() - t0
    battery_units = len(battery_contexts(cfg, lm)) * len(cfg.battery.lengths)
    with Pool(cfg.updated("cluster", **LOCAL)) as pool:
        list(pool.run([Unit(f"warm-up {i}", 1, noop, None) for i in range(LOCAL["workers"])]))
        t0 = time.perf_counter()
        list(pool.run([Unit(f"empty {i}", 1, noop, None) for i in range(units)]))
        wall = time.perf_counter() - t0
    per_unit = wall / units
    return {
        "units": units,
        "overhead_per_unit_s": per_unit,
        "smoke_battery_unit_s": battery_s / battery_units,
        "ratio": per_unit / (battery_s / battery_units),
    }
