"""The results table: one JSON line per row, appended and fsynced, so a kill at any instant leaves a valid table.

A killed write can leave at most one partial last line; :func:`read_rows` drops it (with a warning) and
:class:`ResultsTable` truncates it before appending, so a resumed run never duplicates or loses a row.  A
table is locked by the process that writes it (a second run of the same config stops with
:class:`TableLocked`), and each row records the hash of the settings it was computed with
(:mod:`niah.rundir`): only rows of the current hash count as done or appear in tables.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class ResultsCorrupt(ValueError):
    """A results file has a damaged line before its end; the message says which and how to keep the rows before it."""


class TableLocked(RuntimeError):
    """Another process is writing this results table."""


def read_rows(path: str | Path, fields: tuple[str, ...] = (), ok_fields: tuple[str, ...] = ()) -> list[dict]:
    """All complete rows of a table (an incomplete last line from a killed write is skipped).

    A row that is not a JSON object, lacks one of ``fields``, or has status ``ok`` without one of ``ok_fields`` is
    set aside with a warning naming its line: it stays in the file but counts neither as done nor in a table, so
    the run redoes it."""
    path = Path(path)
    if not path.exists():
        return []
    rows, lines, aside = [], path.read_bytes().split(b"\n"), []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if why := _invalid(row, fields, ok_fields):
                aside.append(f"line {i + 1} {why}")
            else:
                rows.append(row)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if i == len(lines) - 1:
                warnings.warn(f"{path}: dropped an incomplete last row (a killed write)", stacklevel=2)
            else:
                raise ResultsCorrupt(
                    f"{path} is damaged at line {i + 1} (not JSON); the {len(rows)} rows before it are intact. "
                    f"Run `python -m niah repair {path}` to keep them and move line {i + 1} onwards aside; "
                    "the run then redoes the rows that were moved."
                ) from None
    if aside:
        warnings.warn(
            f"{path}: {len(aside)} rows set aside and redone by the next run ({'; '.join(aside[:3])}"
            f"{'; ...' if len(aside) > 3 else ''})",
            stacklevel=2,
        )
    return rows


def _invalid(row, fields: tuple[str, ...], ok_fields: tuple[str, ...]) -> str:
    """Why ``row`` does not fit the table's schema (:func:`read_rows`), or ""."""
    if not isinstance(row, dict):
        return "is not a JSON object"
    missing = [f for f in fields if f not in row] or [
        f for f in ok_fields if row.get("status") == "ok" and f not in row
    ]
    return f"has no {missing[0]!r}" if missing else ""


def move_tail_aside(path: str | Path) -> tuple[Path | None, int, int]:
    """Keep the intact rows before the first damaged line of ``path``; move the rest to ``<path>.damaged-<time>``.
    Returns (where the tail went, rows kept, lines moved); (None, rows, 0) for a file with no damaged line, left as
    it is."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    cut = 0
    for line in lines:
        try:
            if line.strip():
                json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            break
        cut += 1
    if cut == len(lines):
        return None, sum(1 for line in lines if line.strip()), 0
    tail = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    tail.write_bytes(b"\n".join(lines[cut:]))
    kept = b"".join(line + b"\n" for line in lines[:cut])
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(kept)
    os.replace(tmp, path)
    return tail, sum(1 for line in lines[:cut] if line.strip()), sum(1 for line in lines[cut:] if line.strip())


def current_rows(
    rows: list[dict], key_fields: tuple[str, ...], settings_hash: str | None
) -> tuple[list[dict], list[str]]:
    """The rows of ``settings_hash`` (all rows when it is None), one per key: a later row replaces an earlier
    ``error`` row of its key (a redone cell).  Also the notes on what was left out."""
    notes = []
    if settings_hash is not None:
        stale = [r for r in rows if r.get("settings_hash") != settings_hash]
        if stale:
            notes.append(
                f"{len(stale)} rows from other settings (an edited config, or an older version of this code) "
                "are kept in the file but left out of the tables"
            )
        rows = [r for r in rows if r.get("settings_hash") == settings_hash]
    by_key: dict[tuple, dict] = {}
    duplicates = 0
    for r in rows:
        k = _key(r, key_fields)
        # an error row is redone on resume, so a later row of its key replaces it; two good rows are a duplicate
        if k in by_key and by_key[k].get("status") != "error" and r.get("status") != "error":
            duplicates += 1
            continue
        by_key[k] = r
    if duplicates:
        notes.append(
            f"{duplicates} rows repeat the key of an earlier row (two runs wrote at once?); each key is counted once"
        )
    return list(by_key.values()), notes


def _key(row: dict, key_fields: tuple[str, ...]) -> tuple:
    return tuple(json.dumps(row.get(f)) for f in key_fields)


_HELD: dict[Path, int] = {}  # lock files this process holds, until it exits


def _lock_path(target: Path) -> Path:
    """The lock file of ``target``: ``<target>.lock`` beside it."""
    return target.with_name(target.name + ".lock").resolve()


def _open_lock(lock: Path) -> int:
    """A descriptor of the lock file ``lock`` (created if need be), not locked yet."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)


def hold_lock(target: Path, what: str) -> None:
    """Lock ``<target>.lock`` for the rest of this process, or raise :class:`TableLocked` naming the holder."""
    lock = _lock_path(target)
    if lock in _HELD:
        return
    fd = _open_lock(lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TableLocked(
            f"{what} is in use by another run (pid {holder}); wait for it to finish or stop it, then run again"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[lock] = fd


@contextmanager
def locked(target: Path, waiting: str) -> Iterator[None]:
    """Hold ``<target>.lock`` for the ``with`` block; while another process holds it, print ``waiting`` (one line,
    on stderr) and wait for it.  The lock goes with its process, so a killed holder never blocks the next one."""
    fd = _open_lock(_lock_path(target))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"niah: {waiting}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class ResultsTable:
    """Append-only JSONL table whose rows are identified by ``key_fields``.

    ``settings_hash`` (see :mod:`niah.rundir`) is written into every row; only rows with it, and not
    ``error`` rows, count as done.  ``nan_free`` names fields that must not be NaN in an ``ok`` row: a row
    where one is gets written as ``status: error`` with the reason.  ``fields`` (default: the key) and
    ``ok_fields`` (of ``ok`` rows) are the schema a row read back must fit, else it is redone (:func:`read_rows`).
    """

    def __init__(
        self,
        path: str | Path,
        key_fields: tuple[str, ...],
        settings_hash: str | None = None,
        nan_free: tuple[str, ...] = (),
        fields: tuple[str, ...] = (),
        ok_fields: tuple[str, ...] = (),
    ):
        self.path = Path(path)
        self.key_fields, self.settings_hash, self.nan_free = key_fields, settings_hash, nan_free
        self.schema = (fields or key_fields, ok_fields)  # read_rows sets aside the rows that lack a field
        hold_lock(self.path, f"results table {self.path}")
        self._drop_partial_tail()
        rows, _ = current_rows(read_rows(self.path, *self.schema), key_fields, settings_hash)
        self.done = {self.key(r) for r in rows if r.get("status") != "error"}

    def key(self, row: dict) -> tuple:
        return _key(row, self.key_fields)

    def _drop_partial_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a killed write's partial last line: the next row starts clean
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def _checked(self, row: dict) -> dict:
        if row.get("status") != "ok":
            return row
        bad = [f for f in self.nan_free if isinstance(row.get(f), float) and math.isnan(row[f])]
        if not bad:
            return row
        return {
            **row,
            "status": "error",
            "reason": (
                f"{', '.join(bad)} is NaN: the model computed NaN values here (damaged weights, or an overflow), "
                "so the row is not scored"
            ),
        }

    def append(self, row: dict) -> None:
        """Write one row (skipped if its key is already done)."""
        key = self.key(row)
        if key in self.done:
            return
        row = self._checked(row)
        if self.settings_hash is not None:
            row = {**row, "settings_hash": self.settings_hash}
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:  # unbuffered: what reached the file is known, and nothing is retried at close
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:  # a full disk: take back the part of the row that got written, so the file stays whole
                os.ftruncate(fd, end)
                raise
        finally:
            os.close(fd)
        if row.get("status") != "error":
            self.done.add(key)

    def rows(self) -> list[dict]:
        return current_rows(read_rows(self.path, *self.schema), self.key_fields, self.settings_hash)[0]
