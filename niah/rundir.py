"""One config's run folder, ``papermill_runs/<name>/``: its file names, and the result tables in it.

Each table kind names its file, the fields that identify a row, and the settings its rows depend on.  A row
records the hash of those settings (``settings_hash``), so that a config edited under the same ``name:`` redoes
its rows instead of mixing old rows with new settings: rows of another hash stay in the file but count neither
as done nor in any table.  Settings that only choose *which* rows exist (methods, lengths, ...) are left out
of the hash, so that adding a method runs only that method.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import ROOT, Config
from .results import ResultsTable, current_rows, read_rows
from .schema import KVPPL, LLAMACPP, NEEDLES, SECTIONS, SWEEP, WEIGHT_NEEDLES, WEIGHTS, Top

NEEDLE_KEY = ("config", "model", "prompt_style", "length", "depth", "trial", "method")


@dataclass(frozen=True)
class TableKind:
    """A results table: its ``file``, the fields that identify a row, the fields of an ``ok`` row that must not
    be NaN (a NaN one makes it an error row), and those an ``ok`` row must hold (every row holds its key and a
    ``status``; a row read back without them is redone).  The settings its rows depend on are declared with each
    setting (:func:`hashed_settings`)."""

    name: str
    file: str
    key: tuple[str, ...]
    nan_free: tuple[str, ...] = ()
    ok_fields: tuple[str, ...] = ()

    @property
    def schema(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The fields every row holds, and those every ``ok`` row holds besides (:func:`niah.results.read_rows`)."""
        return (*self.key, "status"), self.ok_fields

    @property
    def hashed(self) -> tuple[str, ...]:
        """Config settings (``section`` or ``section.key``) the rows depend on."""
        return hashed_settings(self.name)[0]

    @property
    def ignored(self) -> tuple[str, ...]:
        """Settings inside ``hashed`` that only choose which rows exist."""
        return hashed_settings(self.name)[1]


TABLES = {
    t.name: t
    for t in (
        TableKind(NEEDLES, "niah_results.jsonl", NEEDLE_KEY, ("answer_logprob", "kl_vs_ref"), ("score",)),
        TableKind(SWEEP, "sweep_results.jsonl", ("config", "model", "method", "length"), (), ("kv_bytes",)),
        TableKind(
            KVPPL,
            "kv_perplexity.jsonl",
            ("config", "model", "method", "window"),
            ("nll_sum", "kl_vs_ref"),
            ("nll_sum",),
        ),
        TableKind(WEIGHTS, "weightquant_results.jsonl", ("config", "model", "scheme"), ("ppl",)),  # rows of 2 kinds
        TableKind(
            WEIGHT_NEEDLES,
            "weightquant_niah.jsonl",
            ("config", "model", "weights", "prompt_style", "length", "depth", "trial", "method"),
            ("answer_logprob",),
            ("score",),
        ),
        TableKind(LLAMACPP, "llamacpp_results.jsonl", NEEDLE_KEY, ("answer_logprob", "kl_vs_ref"), ("score",)),
    )
}


def hashed_settings(table: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The settings (``section`` or ``section.key``) that the rows of ``table`` depend on, and those among them that
    only choose which rows exist (left out of the table's hash), read from the declarations above."""
    hashed, rows = [], []
    for k, m in Top.settings().items():
        if table in m["hashed_by"]:
            hashed.append(k)
    for name, cls in SECTIONS.items():
        whole = table in cls.HASHED_BY
        if whole:
            hashed.append(name)
        for k, m in cls.settings().items():
            if table in m["hashed_by"] and not whole:
                hashed.append(f"{name}.{k}")
            if table in m["rows"] and whole:
                rows.append(f"{name}.{k}")
    return tuple(hashed), tuple(rows)


def conditionally_hashed(table: str) -> list[tuple[str, Callable]]:
    """The settings (``section.key``) that ``table`` hashes only where their ``hashed_when`` condition holds."""
    return [
        (f"{name}.{k}", m["hashed_when"][table])
        for name, cls in SECTIONS.items()
        for k, m in cls.settings().items()
        if table in m["hashed_when"]
    ]


def _kind(kind: str) -> TableKind:
    if kind not in TABLES:
        raise ValueError(f"unknown results table {kind!r}: choose one of {', '.join(TABLES)}")
    return TABLES[kind]


def _setting(raw: dict, dotted: str):
    section, _, key = dotted.partition(".")
    value = raw.get(section)
    return (value or {}).get(key) if key else value


def settings_hash(cfg: Config, kind: str) -> str:
    """12 hex digits identifying the settings that rows of table ``kind`` depend on, as the YAML wrote them
    (``cfg.raw``: a setting written out at its default hashes apart from one left out)."""
    spec = _kind(kind)
    body = {}
    for dotted in spec.hashed:
        value = _setting(cfg.raw, dotted)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{dotted}.{k}" not in spec.ignored}
        body[dotted] = value
    for dotted, when in conditionally_hashed(kind):
        if when(cfg):
            body[dotted] = _setting(cfg.raw, dotted)
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:12]


def open_table(cfg: Config, kind: str, path: str | Path) -> ResultsTable:
    """The resumable, locked table of ``kind`` at ``path`` for ``cfg``'s current settings."""
    spec = _kind(kind)
    return ResultsTable(path, spec.key, settings_hash(cfg, kind), spec.nan_free, *spec.schema)


def selection(cfg: Config, kind: str) -> dict[str, dict[str, set]]:
    """The values of the row fields that ``cfg`` selects for table ``kind``, per source of rows: ``{"battery":
    {"method": {...}, "length": {...}}, "grid": {...}}`` for needle rows (a battery row names its ``context``), one
    ``"all"`` entry for the sweep and perplexity rows; empty (the other tables): every row counts.  Rows of a
    method or length dropped from the config stay in the file but out of tables."""
    n, b = cfg.niah, cfg.battery
    if kind == NEEDLES:
        grid = {"method": {n.reference, *n.methods}, "length": set(n.lengths)}
        if not b.present:
            return {"grid": grid}
        return {"grid": grid, "battery": {"method": set(b.methods), "length": set(b.lengths)}}
    if kind == SWEEP:
        return {"all": {"method": set(cfg.sweep.methods), "length": set(cfg.sweep.lengths)}}
    if kind == KVPPL:
        return {"all": {"method": set(cfg.kv_perplexity.methods)}}
    return {}


def _selected(row: dict, chosen: dict[str, dict[str, set]]) -> bool:
    source = "all" if "all" in chosen else ("battery" if "context" in row else "grid")
    return all(row.get(field) in values for field, values in chosen.get(source, {}).items())


def load_table(cfg: Config, kind: str, path: str | Path):
    """The rows of table ``kind`` at ``path`` that belong to ``cfg``'s current settings and :func:`selection`, as a
    DataFrame (each row key once; a warning says what was left out)."""
    import pandas as pd  # heavy: pandas, only where a table is shown (the runners only append rows)

    spec = _kind(kind)
    rows, notes = current_rows(read_rows(path, *spec.schema), spec.key, settings_hash(cfg, kind))
    chosen = selection(cfg, kind) if rows else {}
    kept = [r for r in rows if _selected(r, chosen)]
    if len(kept) < len(rows):
        notes.append(
            f"{len(rows) - len(kept)} rows of methods or lengths this config no longer selects left out "
            "(they stay in the file)"
        )
    for note in notes:
        warnings.warn(f"{path}: {note}", stacklevel=2)
    return pd.DataFrame(kept)


class RunDir:
    """The folder of one config's run and the names of everything in it."""

    def __init__(self, cfg: Config, folder: str | Path | None = None):
        self.cfg = cfg
        self.path = Path(folder) if folder else ROOT / "papermill_runs" / cfg.name

    def file(self, kind: str) -> Path:
        return self.path / _kind(kind).file

    def table(self, kind: str) -> ResultsTable:
        return open_table(self.cfg, kind, self.file(kind))

    def rows(self, kind: str):
        return load_table(self.cfg, kind, self.file(kind))

    @property
    def cold_warm(self) -> Path:
        return self.path / "cold_warm.json"

    @property
    def ledger(self) -> Path:
        return self.path / "claims_ledger.md"

    @property
    def timing(self) -> Path:
        return self.path / "timing.json"

    @property
    def report(self) -> Path:
        return self.path / "report.html"
