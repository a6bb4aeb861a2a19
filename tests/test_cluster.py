"""The battery, the sweep and perplexity through the cache on a local 2-CPU Ray cluster: the same rows as one
process, a worker killed mid-run, a killed driver resumed."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from niah.config import ROOT, load_config
from niah.experiments.battery import run_battery
from niah.experiments.kvppl import run_kv_perplexity
from niah.experiments.sweep import run_sweep
from niah.models import load_model

ray = pytest.importorskip("ray")

CLUSTER = {"engine": "ray", "address": None, "workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1}
TIMING = ("time", "worker", "peak_memory_bytes", "trace_t", "trace_bytes")  # and every key *_s, *_per_token, tpot_*


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def smoke():
    cfg = load_config("smoke")
    return cfg, load_model(cfg.model)


def _rows(path):
    return [json.loads(line) for line in open(path)]


def _key(r):
    return (r["length"], r["depth"], r["trial"], r["method"])


def _measured(r):
    """A row without what may differ between runs: timings (``*_s``, ``*_per_token``, ``tpot*``), memory
    readings of the process, the time and the worker."""
    return {
        k: v
        for k, v in r.items()
        if k not in TIMING and not k.endswith(("_s", "_per_token")) and not k.startswith("tpot")
    }


def test_cluster_rows_equal_one_process(local_cluster, smoke, tmp_path):
    cfg, lm = smoke
    one = run_battery(cfg, lm, tmp_path / "one.jsonl", progress=False)
    many = run_battery(cfg.updated("cluster", **CLUSTER), lm, tmp_path / "many.jsonl", progress=False)
    a, b = {_key(r): r for r in _rows(one)}, {_key(r): r for r in _rows(many)}
    assert len(a) == len(_rows(one)) == 32 and a.keys() == b.keys()
    assert all(_measured(a[k]) == _measured(b[k]) for k in a)
    assert {r["worker"].split("/")[-1] for r in b.values()} <= {"ray-worker-0", "ray-worker-1"}
    assert all(r["status"] == "ok" for r in b.values())


@pytest.mark.parametrize("run, key", [(run_sweep, ("length", "method")), (run_kv_perplexity, ("window", "method"))])
def test_sweep_and_perplexity_rows_equal_one_process(local_cluster, smoke, tmp_path, run, key):
    cfg, lm = smoke
    one = run(cfg, lm, tmp_path / "one.jsonl", progress=False)
    many = run(cfg.updated("cluster", **CLUSTER), lm, tmp_path / "many.jsonl", progress=False)
    a, b = ({tuple(r[k] for k in key): r for r in _rows(p)} for p in (one, many))
    assert len(a) == len(_rows(one)) == len(_rows(many)) > 6 and a.keys() == b.keys()
    assert all(_measured(a[k]) == _measured(b[k]) for k in a)
    assert {r["worker"].split("/")[-1] for r in b.values()} == {"ray-worker-0", "ray-worker-1"}


def test_unit_of_a_killed_worker_runs_once_on_another(local_cluster, smoke, tmp_path, monkeypatch):
    from niah import cluster

    cfg, lm = smoke
    run = cluster.Pool.run
    killed = []

    def kill_after_first(self, units):  # the first unit's rows arrive, then a worker dies
        rows = run(self, units)
        yield next(rows)
        killed.append(self.actors[0])
        ray.kill(self.actors[0])
        yield from rows

    monkeypatch.setattr(cluster.Pool, "run", kill_after_first)
    path = run_battery(cfg.updated("cluster", **CLUSTER), lm, tmp_path / "t.jsonl", progress=False)
    counts = Counter(_key(r) for r in _rows(path))
    assert killed and len(counts) == 32 and set(counts.values()) == {1}


DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    from niah.config import load_config
    from niah.experiments.base import Experiment
    from niah.experiments.battery import run_battery
    from niah.models import load_model

    write = Experiment.write_from_worker
    def write_then_die(self, rows):  # the driver is killed right after it wrote its first unit's rows
        write(self, rows)
        os.kill(os.getpid(), signal.SIGKILL)
    Experiment.write_from_worker = write_then_die
    cfg = load_config("smoke")
    cluster = {"engine": "ray", "address": None, "workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1}
    run_battery(cfg.updated("cluster", **cluster), load_model(cfg.model), sys.argv[1], progress=False)
    """
)


def test_killed_driver_resumes_with_no_row_lost_or_doubled(local_cluster, smoke, tmp_path):
    cfg, lm = smoke
    path = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(path)], env=env, cwd=ROOT, capture_output=True, timeout=300
    )
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    before = len(_rows(path))
    assert 0 < before < 32
    run_battery(cfg.updated("cluster", **CLUSTER), lm, path, progress=False)
    counts = Counter(_key(r) for r in _rows(path))
    assert len(counts) == 32 and set(counts.values()) == {1}


def test_many_small_units_each_come_back_once(local_cluster, smoke):
    from niah.cluster import Pool, Unit
    from niah.experiments.clusterbench import noop

    cfg, _ = smoke
    with Pool(cfg.updated("cluster", **CLUSTER)) as pool:
        units = [Unit(f"empty {i}", i, noop, i) for i in range(120)]
        done = [row for rows in pool.run(units) for row in rows]
    assert sorted(r["payload"] for r in done) == list(range(120))
    assert {r["worker"].split("/")[-1] for r in done} == {"ray-worker-0", "ray-worker-1"}
