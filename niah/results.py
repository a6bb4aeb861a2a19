"""The results table: one JSON line per row, appended and fsynced, so a kill at any instant leaves a valid table.

A killed write can leave at most one partial last line; :func:`read_rows` drops it (with a warning) and
:class:`ResultsTable` truncates it before appending, so a resumed run never duplicates or loses a row.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path


def read_rows(path: str | Path) -> list[dict]:
    """All complete rows of a table (an incomplete last line from a killed write is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows, lines = [], path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: dropped an incomplete last row (a killed write)", stacklevel=2)
            else:
                raise ValueError(f"{path} is corrupt at line {i + 1}: not JSON. Move the file away to start over.") from None
    return rows


class ResultsTable:
    """Append-only JSONL table whose rows are identified by ``key_fields``."""

    def __init__(self, path: str | Path, key_fields: tuple[str, ...]):
        self.path = Path(path)
        self.key_fields = key_fields
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_partial_tail()
        self.done = {self.key(r) for r in read_rows(self.path)}

    def key(self, row: dict) -> tuple:
        return tuple(json.dumps(row.get(f)) for f in self.key_fields)

    def _drop_partial_tail(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict) -> None:
        """Write one row (skipped if its key is already present)."""
        key = self.key(row)
        if key in self.done:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done.add(key)

    def rows(self) -> list[dict]:
        return read_rows(self.path)
