"""Configs: one YAML file per hardware setup under ``configs/``, validated with clear errors."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import yaml

from .prompts import STYLES

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"

DEFAULTS = {
    "device": "cpu",
    "threads": 2,
    "seed": 1234,
    "haystack": "pydoc",
    "haystack_folder": "data/haystack",
    "niah": {
        "lengths": [1024, 2048],
        "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "trials": 1,
        "needle": {"kind": "number", "variant": "single", "count": 4},
        "prompt_styles": ["completion"],
        "methods": ["fp16"],
        "reference": "fp16",
        "max_new_tokens": 12,
        "prefill_chunk": 1024,
    },
}
REQUIRED = ("name", "model")


class ConfigError(ValueError):
    """A config file is missing, malformed or asks for something impossible; the message says which and how to fix it."""


def _merge(base: dict, over: dict, where: str, strict: bool) -> dict:
    """``base`` updated with ``over``; with ``strict`` an unknown key is an error naming the valid ones."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if strict and k not in base:
            raise ConfigError(f"unknown setting {where}{k!r}; valid settings here: {', '.join(sorted(base))}")
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out[k] = _merge(base[k], v, f"{where}{k}.", strict=k == "niah")
        else:
            out[k] = v
    return out


def config_path(name: str) -> Path:
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"no config named {name!r}: choose one of {', '.join(names)} (files in {CONFIG_DIR})")
    return path


def load_config(name: str) -> dict:
    """Read ``configs/<name>.yaml`` (or a path), fill defaults, validate, and add ``hash``."""
    path = config_path(name)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of settings")
    return validate(raw, str(path))


def validate(raw: dict, where: str = "config") -> dict:
    """Defaults filled in and every setting checked; raises :class:`ConfigError`."""
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing required setting(s) {', '.join(missing)}")
    cfg = _merge({**DEFAULTS, "name": None, "model": {}, "description": "", "sweep": {}, "weightquant": {}, "kv_perplexity": {}, "battery": {}, "weight_model": None}, raw, "", strict=True)
    n = cfg["niah"]
    if not n["lengths"] or any(not isinstance(x, int) or x <= 0 for x in n["lengths"]):
        raise ConfigError(f"{where}: niah.lengths must be positive integers (tokens); got {n['lengths']}")
    if any(not 0.0 <= float(d) <= 1.0 for d in n["depths"]):
        raise ConfigError(f"{where}: niah.depths must lie in [0, 1]; got {n['depths']}")
    if not isinstance(n["trials"], int) or n["trials"] < 1:
        raise ConfigError(f"{where}: niah.trials must be a positive integer")
    bad = [s for s in n["prompt_styles"] if s not in STYLES]
    if bad:
        raise ConfigError(f"{where}: unknown prompt style(s) {bad}; choose from {list(STYLES)}")
    from .kv.registry import get_method
    from .needles import NeedleSpec

    try:
        for m in [n["reference"], *n["methods"]]:
            get_method(m)
        NeedleSpec(**n["needle"])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if n["reference"] not in n["methods"]:
        n["methods"] = [n["reference"], *n["methods"]]
    cfg["hash"] = config_hash(cfg)
    return cfg


def config_hash(cfg: dict) -> str:
    """12 hex digits of the sha256 of the config's canonical JSON (without the hash itself)."""
    body = {k: v for k, v in cfg.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def weight_model(cfg: dict) -> dict:
    """The model spec of the weight-quantization notebooks (01, 02): ``weight_model:`` if set, else ``model:``."""
    return cfg["weight_model"] or cfg["model"]
