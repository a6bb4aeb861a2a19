"""Scale one config's independent cells out on Ray, with the driver as the only writer of its results tables.

A config with a ``cluster:`` section (or a run given ``--cluster ADDRESS``, which sets
:data:`niah.config.CLUSTER_ENV`) hands its units of work to Ray actors: the needle battery (one prefill's worth of
questions), perplexity through the cache (a window) and the sweep (a length and method).  Each actor loads the
config's model once, on one GPU, on CPU threads, or spread over ``gpus_per_worker`` GPUs.  The driver plans the
units from the rows still missing, sends the longest first, and appends each unit's rows as they come back, so the
table's resume, lock and settings hash work as in one process.  A unit whose worker dies is sent once more, to
another worker.  Ray is an optional extra (``pip install -e .[ray]``), imported only here and only when a cluster
is asked for; a machine without a cluster gets a local one.  See docs/design-notes.md#niah.cluster.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import env
from .config import Config
from .models import load_model


class ClusterError(RuntimeError):
    """The cluster could not run a unit: Ray is missing, unreachable, or every worker able to take it has died."""


@dataclass(frozen=True)
class Unit:
    """One unit of work: ``work``, called on a worker as ``work(cfg, lm, payload)`` and returning rows without
    provenance (a module-level function, which Ray sends by reference), its ``payload``, a ``name`` for messages
    and a ``size`` (tokens to process; the largest are sent first)."""

    name: str
    size: int
    work: Callable[[Config, Any, Any], list[dict]]
    payload: Any


def worker_name() -> str:
    """The name a single-process row records as its ``worker``: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


# Ray Client reports a ray:// head that is down and one that refuses this driver's token alike, as a timeout
CLIENT_FIX = (
    "start it with `ray start --head`, and for a head with token authentication set RAY_AUTH_MODE=token and "
    "RAY_AUTH_TOKEN (`ray get-auth-token` on the head) here"
)


def _client(address: str | None) -> bool:
    """Whether ``address`` is reached through Ray Client (``ray://host:port``)."""
    return (address or "").startswith("ray://")


def _ray(address: str | None):
    """Ray, imported; a ``ray://`` ``address`` also needs Ray Client (grpcio), which plain ``pip install ray`` lacks."""
    try:
        import ray  # optional extra: ray
    except ImportError:
        raise ClusterError("the config asks for a cluster, but Ray is not installed: pip install -e '.[ray]'") from None
    if _client(address) and importlib.util.find_spec("grpc") is None:
        raise ClusterError(f"the address {address} needs Ray Client, which is not installed: pip install -e '.[ray]'")
    return ray


class _Worker:
    """A Ray actor holding one copy of the config's model (loaded on its first unit)."""

    def __init__(self, cfg: Config, threads: int, gpus: int, name: str):
        self.cfg, self.gpus, self.name, self.lm = cfg, max(1, gpus), name, None
        env.use_threads(threads)

    def run(self, unit: Unit) -> list[dict]:
        if self.lm is None:  # Ray gives the actor its own GPUs only (CUDA_VISIBLE_DEVICES), so they are 0..gpus-1
            self.lm = load_model(self.cfg.model, device=self.cfg.device, gpus=self.gpus)
        rows = unit.work(self.cfg, self.lm, unit.payload)
        return [{**r, "worker": self.name} for r in rows]


class Pool:
    """``workers`` Ray actors for one config, on the cluster at ``address`` (None: a local one started here and
    stopped on :meth:`close`).  Use as a context manager."""

    def __init__(self, cfg: Config):
        s = cfg.cluster
        ray = self.ray = _ray(s.address)
        self.started = not ray.is_initialized()
        if self.started:
            try:
                if s.address:
                    ray.init(address=s.address, logging_level="ERROR", log_to_driver=False)
                else:
                    ray.init(
                        num_cpus=s.workers * s.cpus_per_worker,
                        num_gpus=s.workers * s.gpus_per_worker,
                        include_dashboard=False,
                        logging_level="ERROR",
                        log_to_driver=False,
                    )
            except (ConnectionError, RuntimeError, ValueError) as err:
                reason = str(err).strip().splitlines()[-1]  # Ray Client puts the head's traceback before its error
                fix = f"; {CLIENT_FIX}" if _client(s.address) else ""
                raise ClusterError(
                    f"could not reach the Ray cluster at {s.address or 'a new local cluster'}: {reason}{fix}"
                ) from None
        actor = ray.remote(_Worker)
        host = socket.gethostname()
        self.actors = [
            actor.options(
                name=f"niah-worker-{i}",
                num_cpus=s.cpus_per_worker,
                num_gpus=s.gpus_per_worker,
                max_restarts=0,
                max_task_retries=0,
            ).remote(cfg, s.cpus_per_worker, s.gpus_per_worker, f"{host}/ray-worker-{i}")
            for i in range(s.workers)
        ]

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self.started:
            self.ray.shutdown()

    def run(self, units: list[Unit]) -> Iterator[list[dict]]:
        """Each unit's rows, in the order they finish; the largest units are sent first, one per idle worker.  A
        unit whose worker died goes to another worker once; a second death raises :class:`ClusterError`."""
        ray = self.ray
        queue = sorted(units, key=lambda u: -u.size)
        idle, pending, deaths = list(self.actors), {}, {}
        while queue or pending:
            while queue and idle:
                unit, worker = queue.pop(0), idle.pop(0)
                pending[worker.run.remote(unit)] = (unit, worker)
            if not pending:
                raise ClusterError(f"every worker has died; {len(queue)} units were not run (rerun to resume)")
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            unit, worker = pending.pop(ref)
            try:
                rows = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self.actors.remove(worker)
                deaths[id(unit)] = deaths.get(id(unit), 0) + 1
                if deaths[id(unit)] > 1:
                    raise ClusterError(
                        f"{unit.name}: its worker died twice (last: {str(err).splitlines()[0]}); rerun to resume"
                    ) from None
                queue.insert(0, unit)
                continue
            idle.append(worker)
            yield rows


def run_units(cfg: Config, units: list[Unit], write: Callable[[list[dict]], None]) -> None:
    """Run ``units`` on a :class:`Pool` for ``cfg`` (cluster settings ``s``) and ``write`` each unit's rows as
    they arrive (the driver's table is the only writer)."""
    with Pool(cfg) as pool:
        for rows in pool.run(units):
            write(rows)
