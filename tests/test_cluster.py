"""The battery, the sweep and perplexity through the cache on a local 2-CPU Ray cluster: the same rows as one
process, a worker killed mid-run, a killed driver resumed; and units sent to a head node through a ray:// address."""

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

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


def _free_ports(n):
    """``n`` ports free on this machine now, all different (held together while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def head():
    """A head node started here by ``ray start --head --block`` with token authentication on: its Ray Client address
    and the environment holding the token.  Teardown stops this node only (``--block`` stops its processes on
    SIGTERM); ``ray stop --force`` would kill every Ray cluster on the machine, this module's own included."""
    port, client = _free_ports(2)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # a short directory: the Unix socket paths Ray makes under it must fit in 107 characters
    with tempfile.TemporaryDirectory(prefix="ray", ignore_cleanup_errors=True) as temp:
        log = Path(temp) / "start.log"
        cmd = [Path(sys.executable).parent / "ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2"]
        cmd += [f"--ray-client-server-port={client}", "--include-dashboard=false", "--disable-usage-stats"]
        with open(log, "w") as out:
            proc = subprocess.Popen([*cmd, f"--temp-dir={temp}"], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "Ray runtime started" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.5)
            yield f"ray://127.0.0.1:{client}", env, Path(temp)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


CLIENT_DRIVER = textwrap.dedent(
    """
    import json, sys
    from niah.cluster import Unit, run_units
    from niah.config import load_config
    from niah.experiments.clusterbench import noop

    cluster = {"engine": "ray", "address": sys.argv[1], "workers": 1, "gpus_per_worker": 0, "cpus_per_worker": 1}
    rows = []
    units = [Unit(f"empty {i}", i, noop, i) for i in range(4)]
    run_units(load_config("smoke").updated("cluster", **cluster), units, rows.extend)
    print(json.dumps(rows))
    """
)


def test_ray_client_address_reaches_a_head_node(head):
    address, env, temp = head
    for attempt in range(2):
        # a driver of its own: in this process a Pool would use the Ray already running here, the module's local cluster
        done = subprocess.run(
            [sys.executable, "-c", CLIENT_DRIVER, address],
            env={**env, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )
        # Ray's proxy sometimes fails to start the per-client server (3 times in about 14 runs on this 2-core machine,
        # 2026-12-07); a second connection then succeeds, as a user's retry would
        if done.returncode == 0 or "Starting Ray client server failed" not in done.stderr.decode():
            break
    logs = "".join(p.read_text()[-1500:] for p in temp.glob("session_*/logs/ray_client_server_*.err"))
    assert done.returncode == 0, done.stderr.decode()[-2000:] + "\n" + logs
    rows = json.loads(done.stdout.decode().splitlines()[-1])
    assert sorted(r["payload"] for r in rows) == [0, 1, 2, 3]
    assert {r["worker"].split("/")[-1] for r in rows} == {"ray-worker-0"}
