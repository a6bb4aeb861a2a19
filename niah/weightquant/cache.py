"""Quantized weights cached outside git, keyed by everything that made them.

``cache_dir()/weightquant/<key>/linears.safetensors`` (packed layers and the run record, safetensors only,
never pickle) and ``key.json`` (what the key hashes: model spec, scheme, calibration hash, settings,
library version).  A second run with the same key loads instead of recalibrating.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..models import cache_dir
from .pack import PackedLinear, load_packed, save_packed


@dataclass
class Cached:
    layers: dict[str, PackedLinear]
    record: dict
    hit: bool
    path: Path

    @property
    def file_bytes(self) -> int:
        return self.path.stat().st_size


def cache_key(parts: dict) -> str:
    """16 hex digits of the sha256 of ``parts`` as canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached(parts: dict, build: Callable[[], tuple[dict[str, PackedLinear], dict]]) -> Cached:
    """Load the layers keyed by ``parts``, or ``build()`` them (returning ``(layers, record)``) and store them."""
    folder = cache_dir() / "weightquant" / cache_key(parts)
    path = folder / "linears.safetensors"
    if path.exists():
        layers, record = load_packed(path)
        return Cached(layers, record, True, path)
    layers, record = build()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(parts, indent=1, sort_keys=True, default=str))
    save_packed(path, layers, record)
    return Cached(layers, record, False, path)
