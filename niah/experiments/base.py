"""What every experiment loop shares: a resumable results table, the provenance of each row, and the rows left
by a context that is too long for the model or a run out of memory.

An experiment (grid, battery, sweep, perplexity through the cache, llama.cpp, the weight schemes' needles)
opens one :class:`Experiment`, asks it which of its rows are still missing, and writes rows through it, so a
killed run resumes where it stopped and every row says which config, model, commit and versions made it.  A
cluster worker writes its rows to a :class:`Collect` instead; the loops take either as a :class:`RowSink`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from tqdm.auto import tqdm

from .. import env
from ..cluster import worker_name
from ..config import Config, ConfigError
from ..rundir import RunDir, open_table

STATUS_REASON_CHARS = 300  # an error message is cut to this many characters in its row


def provenance(cfg: Config, model_name: str) -> dict:
    """The columns every result row starts with: the config, its hash, the model, the seed, the commit, the
    installed versions, the time the row was written and the worker that computed it (on a cluster, a Ray
    actor's name, which the row brings back and which overrides this one)."""
    return {
        "config": cfg.name,
        "config_hash": cfg.hash,
        "model": model_name,
        "seed": cfg.seed,
        "git_commit": env.git_commit(),
        "versions": env.versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "worker": worker_name(),
    }


def too_long_reason(cfg: Config, loaded, prompt: int, answer: int = 0) -> str | None:
    """Why ``prompt`` tokens (context and question) and the room for an answer (``answer`` tokens, the expected
    answer's, or ``niah.max_new_tokens`` where that is more) do not fit the loaded model, naming the fix
    (``model.rope_scaling`` where the model is not extended yet); None if they fit.  A run calls
    :func:`check_answer_room` first, so a prompt that fits with its expected answer is never too long here."""
    limit = loaded.max_context
    tokens = prompt + max(answer, cfg.niah.max_new_tokens)
    if tokens <= limit:
        return None
    extend = " Set model.rope_scaling (e.g. {rope_type: yarn, factor: 2.0}) in the config to extend it."
    hint = "" if limit > loaded.native_context else extend
    return f"context of {tokens} tokens (with question and answer) exceeds the model's limit of {limit} tokens.{hint}"


def check_answer_room(cfg: Config, loaded, prompts: list[tuple[int, int]]) -> None:
    """Refuse, before any row, a ``niah.max_new_tokens`` that leaves no room for the answer after a prompt that fits
    the model with its expected answer.  ``prompts``: (prompt tokens, expected answer tokens) of every question the
    run asks; the advice counts the longest prompt that fits, so following it fits them all."""
    limit, max_new = loaded.max_context, cfg.niah.max_new_tokens
    fitting = [p for p, answer in prompts if p + answer <= limit]  # the others are too long whatever the setting
    if fitting and max(fitting) + max_new > limit:
        raise ConfigError(
            f"niah.max_new_tokens = {max_new} leaves no room for the answer after the longest prompt of this run "
            f"({max(fitting)} tokens) within the model's limit of {limit} tokens; lower niah.max_new_tokens to "
            f"{limit - max(fitting)} or less"
        )


@runtime_checkable
class RowSink(Protocol):
    """Where a run's rows go: an :class:`Experiment` (its results table, in this process) or a :class:`Collect` (a
    cluster worker's list, which the driver writes).  ``row(**keys)`` is a row's start (the keys, and for an
    :class:`Experiment` the provenance); ``fail`` writes rows as not measured (``too_long`` or ``oom``)."""

    cfg: Config

    def row(self, **keys) -> dict: ...

    def write(self, rows: list[dict]) -> None: ...

    def fail(self, rows: list[dict], status: str, reason) -> None: ...


class Experiment:
    """One experiment's results table of ``kind`` (a :data:`~niah.rundir.TABLES` name) for one model.

    ``row(**keys)`` is a row's provenance and keys, ``missing(methods, **keys)`` the methods whose row with those
    keys is not written yet, and ``write``/``fail`` append rows (``fail``: status ``too_long`` or ``oom`` with
    its reason) and move the progress bar opened by ``start``."""

    def __init__(self, cfg: Config, kind: str, model_name: str, out_path: Path | None = None, progress: bool = True):
        self.cfg, self.model_name, self.progress = cfg, model_name, progress
        self.path = Path(out_path) if out_path else RunDir(cfg).file(kind)
        self.table = open_table(cfg, kind, self.path)
        self.bar = None

    def row(self, **keys) -> dict:
        return {**provenance(self.cfg, self.model_name), **keys}

    def done(self, row: dict) -> bool:
        return self.table.key(row) in self.table.done

    def missing(self, methods, **keys) -> list[str]:
        return [m for m in methods if not self.done(self.row(method=m, **keys))]

    def start(self, total: int, desc: str) -> None:
        self.bar = tqdm(total=total, desc=f"{desc} [{self.cfg.name}]", unit="row", disable=not self.progress)

    def write(self, rows: list[dict]) -> None:
        for r in rows:
            self.table.append(r)
        if self.bar is not None:
            self.bar.update(len(rows))

    def fail(self, rows: list[dict], status: str, reason) -> None:
        """Write ``rows`` (each a :meth:`row`) as not measured: ``status`` is ``too_long`` or ``oom``."""
        self.write(not_measured(rows, status, reason))

    def write_from_worker(self, rows: list[dict]) -> None:
        """Write rows a cluster worker computed (a :class:`Collect`'s), with this run's provenance."""
        self.write([self.row(**r) for r in rows])

    def close(self) -> Path:
        if self.bar is not None:
            self.bar.close()
        return self.path


def not_measured(rows: list[dict], status: str, reason) -> list[dict]:
    """``rows`` marked as not measured, with ``status`` (``too_long`` or ``oom``) and the reason, cut short."""
    return [{**r, "status": status, "reason": str(reason)[:STATUS_REASON_CHARS]} for r in rows]


class Collect:
    """Where a cluster worker puts one unit's rows: :class:`Experiment`'s ``cfg``, ``row``, ``write`` and ``fail``
    without a table.  ``row`` holds only the keys; the driver adds the provenance when it writes them."""

    def __init__(self, cfg: Config):
        self.cfg, self.rows = cfg, []

    def row(self, **keys) -> dict:
        return dict(keys)

    def write(self, rows: list[dict]) -> None:
        self.rows.extend(rows)

    def fail(self, rows: list[dict], status: str, reason) -> None:
        self.write(not_measured(rows, status, reason))
