"""Configs: one YAML file per hardware setup under ``configs/``, validated with clear errors."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import yaml

from .data.prompts import STYLES
from .schema import NIAH, SECTIONS, TOP, ConfigError, check_types

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"

DEFAULTS = {**TOP, "niah": NIAH}
REQUIRED = ("name", "model")
# the keys a ``model:`` spec may hold, by source (see niah.models), besides the ones every source takes
MODEL_KEYS = {
    "package": ("package", "file", "sha256"),
    "assembled": ("package", "sha256"),
    "local": ("path",),
    "hub": ("id",),
    "random": ("architecture", "config", "seed"),
}
MODEL_OPTIONAL = ("source", "rope_scaling", "dtype")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


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


MAX_NODES = 100_000  # YAML nodes a config may hold with its aliases expanded; the shipped ones hold a few hundred


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for with every alias inside it written out (``sizes``: the ones counted so far)."""
    if id(node) not in sizes:
        sizes[id(node)] = MAX_NODES + 1  # a node met again while it is still being counted is a cycle: too many
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        sizes[id(node)] = 1 + sum(_expanded(child, sizes) for child in children)
    return sizes[id(node)]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (no ``!!python/...`` tags) that refuses a document whose aliases expand past
    :data:`MAX_NODES` nodes: a "billion laughs" file is small, but the config hash and every reader of its
    settings would walk hundreds of millions of items."""

    def construct_document(self, node: yaml.Node):
        size = _expanded(node, {})
        if size > MAX_NODES:
            raise ConfigError(
                f"its YAML anchors and aliases (&name, *name) expand to {size:,} values, more than the {MAX_NODES:,} a config "
                "may hold (an alias bomb?); write the settings out, or use fewer aliases"
            )
        return super().construct_document(node)


def load_config(name: str) -> dict:
    """Read ``configs/<name>.yaml`` (or a path), fill defaults, validate, and add ``hash``."""
    path = config_path(name)
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of settings")
    return validate(raw, str(path))


def validate(raw: dict, where: str = "config") -> dict:
    """Defaults filled in and every setting checked; raises :class:`ConfigError`."""
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"{where}: missing required setting(s) {', '.join(missing)}")
    cfg = _merge(
        {
            **DEFAULTS,
            "name": None,
            "model": {},
            "description": "",
            **{name: {} for name in SECTIONS},
            "weight_model": None,
        },
        raw,
        "",
        strict=True,
    )
    try:
        check_types("", DEFAULTS, {k: cfg[k] for k in DEFAULTS})
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    name = cfg["name"]
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"{where}: name must be one folder name of letters, digits, '.', '_' or '-' (it names papermill_runs/<name>/); got {name!r}"
        )
    for section in ("model", "weight_model"):
        if cfg[section] is not None or section == "model":
            _check_model(cfg[section], f"{where}: {section}")
    n = cfg["niah"]
    if any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0 for d in n["depths"]):
        raise ConfigError(f"{where}: niah.depths must be numbers in [0, 1] (0 = start of the context, 1 = its end); got {n['depths']}")
    bad = [s for s in n["prompt_styles"] if s not in STYLES]
    if bad:
        raise ConfigError(f"{where}: unknown prompt style(s) {bad}; choose from {list(STYLES)}")
    from .data.needles import NeedleSpec
    from .kv.registry import get_method

    try:
        for m in [n["reference"], *n["methods"]]:
            get_method(m)
        NeedleSpec(**n["needle"])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from None
    if n["reference"] not in n["methods"]:
        n["methods"] = [n["reference"], *n["methods"]]
    _check_haystack(cfg, where)
    _check_sections(cfg, where)
    cfg["hash"] = config_hash(cfg)
    return cfg


def _check_model(spec, where: str) -> None:
    """A ``model:`` spec names a known source and only the keys that source reads."""
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a mapping such as {{source: package, package: ..., file: ..., sha256: ...}}")
    source = spec.get("source")
    if source not in MODEL_KEYS:
        raise ConfigError(f"{where}: unknown model source {source!r}; choose one of {', '.join(MODEL_KEYS)}")
    valid = {*MODEL_KEYS[source], *MODEL_OPTIONAL}
    unknown = sorted(set(spec) - valid)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {unknown} for source {source}; valid: {', '.join(sorted(valid))}")
    missing = [k for k in MODEL_KEYS[source] if source != "random" and not spec.get(k)]
    if missing:
        raise ConfigError(f"{where}: source {source} needs {', '.join(missing)}")
    rope = spec.get("rope_scaling")
    if rope is not None and not (isinstance(rope, dict) and "rope_type" in rope):
        raise ConfigError(f"{where}: rope_scaling must be a mapping with rope_type, e.g. {{rope_type: yarn, factor: 2.0}}; got {rope!r}")


def _check_haystack(cfg: dict, where: str) -> None:
    """The haystack source exists and (for ``folder``) its files decode, before any run folder is made."""
    from .data.haystack import SOURCES, folder_files

    if cfg["haystack"] not in SOURCES:
        raise ConfigError(f"{where}: unknown haystack {cfg['haystack']!r}; choose one of {', '.join(SOURCES)}")
    if cfg["haystack"] == "folder":
        folder = Path(cfg["haystack_folder"])
        try:
            folder_files(folder if folder.is_absolute() else ROOT / folder)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"{where}: {err}") from None


def _check_sections(cfg: dict, where: str) -> None:
    """Every section is read with its defaults once now, so a typo fails at load, not an hour into a run."""
    from .experiments.battery import battery_settings
    from .experiments.kvppl import kv_perplexity_settings
    from .experiments.llamacpp import llamacpp_settings
    from .experiments.sweep import sweep_settings
    from .kv.registry import get_method
    from .weightquant.settings import settings as weightquant_settings

    try:
        for section, read in (
            ("battery", battery_settings),
            ("sweep", sweep_settings),
            ("kv_perplexity", kv_perplexity_settings),
            ("weightquant", weightquant_settings),
            ("llamacpp", llamacpp_settings),
        ):
            if not isinstance(cfg[section], dict):
                raise ConfigError(f"{section} must be a mapping of settings; got {cfg[section]!r}")
            methods = read(cfg).get("methods", [])
            for m in methods or []:
                get_method(m)
        from .cluster import cluster_settings

        cluster_settings(cfg)
    except (ValueError, TypeError) as err:  # ConfigError included
        raise ConfigError(f"{where}: {err}") from None


def config_hash(cfg: dict) -> str:
    """12 hex digits of the sha256 of the config's canonical JSON (without the hash itself and ``cluster:``)."""
    body = {k: v for k, v in cfg.items() if k not in ("hash", "cluster")}  # where cells run does not change their rows
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def weight_model(cfg: dict) -> dict:
    """The model spec of the weight-quantization notebooks (01, 02): ``weight_model:`` if set, else ``model:``."""
    return cfg["weight_model"] or cfg["model"]
