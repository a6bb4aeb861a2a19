"""Configs: one YAML file per hardware setup under ``configs/``, loaded into one frozen, resolved :class:`Config`."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .data.haystack import SOURCES, folder_files
from .data.needles import NeedleSpec
from .data.prompts import STYLES
from .kv.registry import get_method
from .schema import (
    SECTIONS,
    Battery,
    Cluster,
    ConfigError,
    KVPerplexity,
    LlamaCpp,
    Niah,
    Section,
    Sweep,
    Top,
    WeightQuant,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"
# a cluster address for every run of this process and its notebooks: local, auto, ray://...
CLUSTER_ENV = "NIAH_CLUSTER"

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
# the kind of each model-spec key, as a default of that kind (check_value); seed from 0, as the top-level seed
MODEL_KINDS = {k: "" for k in ("source", "package", "file", "sha256", "path", "id", "architecture", "dtype")}
MODEL_KINDS |= {"config": {}, "seed": 0, "rope_scaling": None}
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


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
    """How many nodes ``node`` stands for with every alias inside it written out (``sizes``: the ones counted so
    far)."""
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
                f"its YAML anchors and aliases (&name, *name) expand to {size:,} values, "
                f"more than the {MAX_NODES:,} a config may hold (an alias bomb?); "
                "write the settings out, or use fewer aliases"
            )
        return super().construct_document(node)


MAX_CONFIG_BYTES = 1 << 20  # a config file's largest size; the shipped ones are a few KiB


def _config_text(path: Path) -> str:
    """The text of the config file ``path``, read only if it is a regular file of at most
    :data:`MAX_CONFIG_BYTES` (a symlink to ``/dev/zero`` or a huge file is refused before it fills the memory)."""
    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file (a device, a pipe or a folder?): point to a YAML file")
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)  # the stat size may lie (a growing file): never read more than this
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB, too large for a config: is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: point to a YAML file") from None


def load_config(name: str) -> Config:
    """Read ``configs/<name>.yaml`` (or a path), fill defaults, validate: the resolved :class:`Config`."""
    path = config_path(name)
    text = _config_text(path)
    try:
        raw = yaml.load(text, Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of settings")
    cfg = validate(raw, str(path))
    shipped = path.resolve() == (CONFIG_DIR / f"{cfg.name}.yaml").resolve()
    return replace(cfg, source=cfg.name if shipped else str(path))


@dataclass(frozen=True)
class Config(Top):
    """A loaded config: the top-level settings (:class:`~niah.schema.Top`) and every section filled, checked and
    resolved (``cfg.battery.methods`` has the reference first; ``cfg.battery.present`` says whether the YAML asks
    for a battery).  ``raw``: the settings as written, over the top-level and ``niah`` defaults; the config and
    table hashes and the dry run read it.  ``hash``: :func:`config_hash` of it."""

    niah: Niah = field(default_factory=Niah)
    battery: Battery = field(default_factory=Battery)
    sweep: Sweep = field(default_factory=Sweep)
    kv_perplexity: KVPerplexity = field(default_factory=KVPerplexity)
    llamacpp: LlamaCpp = field(default_factory=LlamaCpp)
    weightquant: WeightQuant = field(default_factory=WeightQuant)
    cluster: Cluster = field(default_factory=Cluster)
    hash: str = ""
    raw: dict = field(default_factory=dict, repr=False)
    # how a command names this config: its name for a file of configs/, else its path (make reproduce CONFIG=<source>)
    source: str = field(default="", repr=False)

    @property
    def weights(self) -> dict:
        """The model spec of the weight-quantization notebooks (01, 02): ``weight_model:`` if set, else ``model:``."""
        return self.weight_model or self.model

    def updated(self, section: str, **settings) -> Config:
        """This config with ``settings`` written over its ``section`` (a top-level setting where ``section`` is
        ``""``), loaded again: checked and resolved as any other config."""
        raw = copy.deepcopy(self.raw)
        if section:
            raw[section] = {**raw[section], **settings}
        else:
            raw.update(settings)
        return replace(validate(raw, self.name), source=self.source)


def companion_configs(cfg: Config) -> list[Config]:
    """The loaded configs of ``cfg.companions``; a companion must name no companions of its own (one level: the
    chain runs each once, and a cycle could not end)."""
    out = [load_config(name) for name in cfg.companions]
    for other in out:
        if other.companions:
            raise ConfigError(f"{cfg.name}'s companion {other.name} names companions of its own: drop them there")
    return out


def validate(raw: dict, where: str = "config") -> Config:
    """``raw`` (a config's YAML as a mapping) with its defaults filled in, every setting checked and every section
    resolved; raises :class:`ConfigError` naming the file, the setting and the fix."""
    try:
        return _resolve(raw, where)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (ValueError, TypeError) as err:  # a method name or needle spec that its own module refused
        raise ConfigError(f"{where}: {err}") from None


def _resolve(raw: dict, where: str) -> Config:
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ConfigError(f"missing required setting(s) {', '.join(missing)}")
    unknown = sorted(set(raw) - {*Top.settings(), *SECTIONS})
    if unknown:
        raise ConfigError(
            f"unknown setting {unknown[0]!r}; valid settings here: {', '.join(sorted({*Top.settings(), *SECTIONS}))}"
        )
    top = {**Top.defaults(), **{k: copy.deepcopy(v) for k, v in raw.items() if k in Top.settings()}}
    check_types(
        "", Top, {k: top[k] for k in ("device", "threads", "seed", "haystack", "haystack_folder", "companions")}
    )
    for other in top["companions"]:
        if not isinstance(other, str):
            raise ConfigError(f"companions lists config names or paths; got {other!r}")
        config_path(other)  # a name that names no config fails here, naming the configs there are
    name = top["name"]
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            "name must be one folder name of letters, digits, '.', '_' or '-' (it names papermill_runs/<name>/); "
            f"got {name!r}"
        )
    for key in ("model", "weight_model"):
        if top[key] is not None or key == "model":  # weight_model may be left out, model may not
            check_model(top[key], key)
    niah = _niah(raw.get("niah", {}))
    _check_haystack(top["haystack"], top["haystack_folder"])
    given = {s: copy.deepcopy(raw.get(s, {})) for s in SECTIONS if s != "niah"}
    given["cluster"] = given["cluster"] or {}  # an empty `cluster:` asks for no cluster, as it always has
    sections = {s: cls(present=bool(given[s]), **filled(s, given[s])) for s, cls in SECTIONS.items() if s != "niah"}
    battery = sections["battery"].resolved(niah)
    resolved = dict(
        niah=niah,
        battery=battery,
        sweep=sections["sweep"].resolved(niah),
        kv_perplexity=sections["kv_perplexity"].resolved(niah),
        llamacpp=sections["llamacpp"].resolved(battery),
        weightquant=sections["weightquant"].resolved(),
        cluster=sections["cluster"].resolved(top["device"], os.environ.get(CLUSTER_ENV, "").strip()),
    )
    for section in resolved.values():
        for m in getattr(section, "methods", None) or []:
            get_method(m)
    body = {**top, "niah": {k: copy.deepcopy(getattr(niah, k)) for k in Niah.settings()}, **given}
    return Config(**top, **resolved, hash=config_hash(body), raw=body)


def _niah(given) -> Niah:
    """The ``niah:`` section: always filled (every experiment reads it), its methods with the reference first."""
    if not isinstance(given, dict):
        raise ConfigError(f"niah must be a mapping of settings; got {given!r}")
    unknown = sorted(set(given) - set(Niah.settings()))
    if unknown:
        raise ConfigError(
            f"unknown setting niah.{unknown[0]!r}; valid settings here: {', '.join(sorted(Niah.settings()))}"
        )
    n = Niah(present=True, **filled("niah", given))
    if any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0 for d in n.depths):
        raise ConfigError(
            f"niah.depths must be numbers in [0, 1] (0 = start of the context, 1 = its end); got {n.depths}"
        )
    bad = [s for s in n.prompt_styles if s not in STYLES]
    if bad:
        raise ConfigError(f"unknown prompt style(s) {bad}; choose from {list(STYLES)}")
    for m in [n.reference, *n.methods]:
        get_method(m)
    NeedleSpec(**n.needle)
    return n if n.reference in n.methods else replace(n, methods=[n.reference, *n.methods])


def check_model(spec, where: str) -> None:
    """A ``model:`` spec names a known source and only the keys that source reads."""
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{where} must be a mapping such as {{source: package, package: ..., file: ..., sha256: ...}}"
        )
    source = spec.get("source")
    if source not in MODEL_KEYS:
        raise ConfigError(f"{where}: unknown model source {source!r}; choose one of {', '.join(MODEL_KEYS)}")
    valid = {*MODEL_KEYS[source], *MODEL_OPTIONAL}
    unknown = sorted(set(spec) - valid)
    if unknown:
        raise ConfigError(
            f"{where}: unknown setting(s) {unknown} for source {source}; valid: {', '.join(sorted(valid))}"
        )
    for key, value in spec.items():
        check_value(f"{where}.{key}", MODEL_KINDS[key], value, lowest=0)
    missing = [k for k in MODEL_KEYS[source] if source != "random" and not spec.get(k)]
    if missing:
        raise ConfigError(f"{where}: source {source} needs {', '.join(missing)}")
    rope = spec.get("rope_scaling")
    if rope is not None and not (isinstance(rope, dict) and "rope_type" in rope):
        raise ConfigError(
            f"{where}: rope_scaling must be a mapping with rope_type, e.g. {{rope_type: yarn, factor: 2.0}}; "
            f"got {rope!r}"
        )


def _check_haystack(haystack: str, folder: str) -> None:
    """The haystack source exists and (for ``folder``) its files decode, before any run folder is made."""
    if haystack not in SOURCES:
        raise ConfigError(f"unknown haystack {haystack!r}; choose one of {', '.join(SOURCES)}")
    if haystack == "folder":
        path = Path(folder)
        try:
            folder_files(path if path.is_absolute() else ROOT / path)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err)) from None


def config_hash(body: dict) -> str:
    """12 hex digits of the sha256 of a config's settings as canonical JSON (``cluster:`` left out: where cells run
    does not change their rows)."""
    body = {k: v for k, v in body.items() if k not in ("hash", "cluster")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def filled(name: str, given: dict | None) -> dict:
    """Section ``name``'s settings: ``given`` over the defaults (a fresh copy; a mapping setting merged one level
    deep).  Raises :class:`ConfigError` naming an unknown or ill-typed setting and the valid ones."""
    cls = SECTIONS[name]
    if not isinstance(given, dict):
        raise ConfigError(f"{name} must be a mapping of settings; got {given!r}")
    defaults = cls.defaults()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown {name} setting(s) {unknown}; valid: {', '.join(sorted(defaults))}")
    check_types(name, cls, given)
    out = copy.deepcopy(defaults)
    for k, v in given.items():
        if isinstance(defaults[k], dict) and defaults[k]:  # an empty default mapping takes any keys (method_lengths)
            bad = sorted(set(v) - set(defaults[k]))
            if bad:
                raise ConfigError(
                    f"unknown {name} setting(s) {name}.{k}.{bad}; valid: {', '.join(sorted(defaults[k]))}"
                )
            out[k].update(v)
        else:
            out[k] = copy.deepcopy(v)
    return out


_KINDS = (
    (bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"),
    (dict, "a mapping"),
)  # fmt: skip
INT_MAX = 2**63 - 1  # torch's largest integer (int64)


def check_types(where: str, cls: type[Section], given: dict) -> None:
    """Every setting of ``given`` is of its default's kind (:func:`check_value`); ``where`` prefixes the names in
    the messages (``""`` for top-level settings)."""
    meta = cls.settings()
    for key, value in given.items():
        m = meta[key]
        check_value(f"{where}.{key}" if where else key, m["default"], value, m["lowest"])


def check_value(name: str, default: Any, value: Any, lowest: int = 1) -> None:
    """``value`` is of ``default``'s kind: a number where the default is a float, never a bool where it is an int,
    anything where it is None.  An integer setting is a count or a size from ``lowest`` to :data:`INT_MAX`, and a list
    whose default holds integers (lengths, bits) is a non-empty list of such.  A list holds each value once.  A
    mapping's known keys are checked the same way, one level down.  Raises :class:`ConfigError` naming the setting,
    the kind it takes and what it got."""
    if isinstance(value, list):  # a repeated length, depth or method would silently ask the same rows twice
        twice = [x for i, x in enumerate(value) if x in value[:i]]
        if twice:
            raise ConfigError(f"{name} lists {twice[0]!r} more than once; list each value once")
    if default is None:
        return
    kind, words = next((k, w) for k, w in _KINDS if isinstance(default, k))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        hint = f" (its default is {default!r})" if default not in ("", {}) else ""  # "" and {}: no default to name
        raise ConfigError(f"{name} must be {words}{hint}; got {value!r}")
    if kind is int and not lowest <= value <= INT_MAX:
        raise ConfigError(f"{name} must be an integer from {lowest} to 2**63 - 1 (torch's largest); got {value!r}")
    if kind is list and default and all(type(x) is int for x in default):
        if not value or not all(type(x) is int and 1 <= x <= INT_MAX for x in value):
            raise ConfigError(
                f"{name} must be a non-empty list of positive integers up to 2**63 - 1 (torch's largest); got {value!r}"
            )
    if kind is dict:
        for k, v in value.items():
            if k in default:
                check_value(f"{name}.{k}", default[k], v)
