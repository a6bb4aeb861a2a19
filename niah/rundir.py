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
from dataclasses import dataclass
from pathlib import Path

from .config import ROOT
from .results import ResultsTable, current_rows, read_rows

COMMON = ("model", "seed", "haystack", "haystack_folder", "device")
NEEDLE_KEY = ("config", "model", "prompt_style", "length", "depth", "trial", "method")


@dataclass(frozen=True)
class TableKind:
    file: str
    key: tuple[str, ...]
    hashed: tuple[str, ...]  # config settings (``section`` or ``section.key``) the rows depend on
    ignored: tuple[str, ...] = ()  # settings inside ``hashed`` that only choose which rows exist
    nan_free: tuple[str, ...] = ()  # fields of an ``ok`` row that must not be NaN (a NaN one makes it an error row)


TABLES = {
    "needles": TableKind(
        "niah_results.jsonl",
        NEEDLE_KEY,
        (*COMMON, "niah", "battery"),
        ("niah.methods", "niah.lengths", "niah.depths", "niah.trials", "niah.prompt_styles", "battery.methods"),
        ("answer_logprob", "kl_vs_ref"),
    ),
    "sweep": TableKind(
        "sweep_results.jsonl",
        ("config", "model", "method", "length"),
        (*COMMON, "threads", "sweep", "niah.reference", "niah.prefill_chunk", "niah.needle"),
        ("sweep.methods", "sweep.lengths"),
    ),
    "kv_perplexity": TableKind(
        "kv_perplexity.jsonl",
        ("config", "model", "method", "window"),
        (*COMMON, "kv_perplexity", "niah.reference", "niah.prefill_chunk", "niah.engine_chunk", "weightquant.calibration_share"),
        ("kv_perplexity.methods", "kv_perplexity.breakdown", "kv_perplexity.breakdown_methods"),
        ("nll_sum", "kl_vs_ref"),
    ),
    "weightquant": TableKind(
        "weightquant_results.jsonl",
        ("config", "model", "scheme"),
        (*COMMON, "weight_model", "weightquant"),
        ("weightquant.kv_methods",),
        ("ppl",),
    ),
    "weightquant_needles": TableKind(
        "weightquant_niah.jsonl",
        ("config", "model", "weights", "prompt_style", "length", "depth", "trial", "method"),
        (*COMMON, "weight_model", "weightquant", "niah", "battery"),
        (
            "niah.methods",
            "niah.lengths",
            "niah.depths",
            "niah.trials",
            "niah.prompt_styles",
            "battery.methods",
            "weightquant.kv_methods",
            "weightquant.needle_lengths",
            "weightquant.needle_schemes",
        ),
        ("answer_logprob",),
    ),
    "llamacpp": TableKind(
        "llamacpp_results.jsonl",
        NEEDLE_KEY,
        (*COMMON, "threads", "niah", "battery", "llamacpp"),
        ("niah.methods", "niah.lengths", "niah.depths", "niah.trials", "battery.methods", "llamacpp.kv", "llamacpp.rotation"),
        ("answer_logprob", "kl_vs_ref"),
    ),
}


def _kind(kind: str) -> TableKind:
    if kind not in TABLES:
        raise ValueError(f"unknown results table {kind!r}: choose one of {', '.join(TABLES)}")
    return TABLES[kind]


def _setting(cfg: dict, dotted: str):
    section, _, key = dotted.partition(".")
    value = cfg.get(section)
    return (value or {}).get(key) if key else value


def settings_hash(cfg: dict, kind: str) -> str:
    """12 hex digits identifying the settings that rows of table ``kind`` depend on."""
    spec = _kind(kind)
    body = {}
    for dotted in spec.hashed:
        value = _setting(cfg, dotted)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if f"{dotted}.{k}" not in spec.ignored}
        body[dotted] = value
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:12]


def open_table(cfg: dict, kind: str, path: str | Path) -> ResultsTable:
    """The resumable, locked table of ``kind`` at ``path`` for ``cfg``'s current settings."""
    spec = _kind(kind)
    return ResultsTable(path, spec.key, settings_hash(cfg, kind), spec.nan_free)


def selection(cfg: dict, kind: str) -> dict[str, dict[str, set]]:
    """The values of the row fields that ``cfg`` selects for table ``kind``, per source of rows: ``{"battery":
    {"method": {...}, "length": {...}}, "grid": {...}}`` for needle rows (a battery row names its ``context``), one
    ``"all"`` entry for the sweep and perplexity rows; empty (the other tables): every row counts.  Rows of a
    method or length dropped from the config stay in the file but out of tables."""
    n, ref = cfg["niah"], cfg["niah"]["reference"]
    if kind == "needles":
        from .experiments.battery import battery_settings

        grid = {"method": {ref, *n["methods"]}, "length": set(n["lengths"])}
        if not cfg.get("battery"):
            return {"grid": grid}
        b = battery_settings(cfg)
        return {"grid": grid, "battery": {"method": set(b["methods"]), "length": set(b["lengths"])}}
    if kind == "sweep":
        from .experiments.sweep import sweep_settings

        s = sweep_settings(cfg)
        return {"all": {"method": set(s["methods"]), "length": set(s["lengths"])}}
    if kind == "kv_perplexity":
        from .experiments.kvppl import kv_perplexity_settings

        return {"all": {"method": set(kv_perplexity_settings(cfg)["methods"])}}
    return {}


def _selected(row: dict, chosen: dict[str, dict[str, set]]) -> bool:
    source = "all" if "all" in chosen else ("battery" if "context" in row else "grid")
    return all(row.get(field) in values for field, values in chosen.get(source, {}).items())


def load_table(cfg: dict, kind: str, path: str | Path):
    """The rows of table ``kind`` at ``path`` that belong to ``cfg``'s current settings and :func:`selection`, as a
    DataFrame (each row key once; a warning says what was left out)."""
    import pandas as pd

    spec = _kind(kind)
    rows, notes = current_rows(read_rows(path), spec.key, settings_hash(cfg, kind))
    chosen = selection(cfg, kind) if rows else {}
    kept = [r for r in rows if _selected(r, chosen)]
    if len(kept) < len(rows):
        notes.append(f"{len(rows) - len(kept)} rows of methods or lengths this config no longer selects left out (they stay in the file)")
    for note in notes:
        warnings.warn(f"{path}: {note}", stacklevel=2)
    return pd.DataFrame(kept)


class RunDir:
    """The folder of one config's run and the names of everything in it."""

    def __init__(self, cfg: dict, folder: str | Path | None = None):
        self.cfg = cfg
        self.path = Path(folder) if folder else ROOT / "papermill_runs" / cfg["name"]

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
