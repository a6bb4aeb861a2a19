"""Names -> KV methods: the registry of quantizers, the grammar of a method name, and each method's layer policy.

A name is ``<method>[+<modifier>...][@strict|@engine]``.  ``<method>`` is a registered quantizer used for keys and
values alike (``q8_0``, ``turbo3``), a pair registered as ``<name>_key`` and ``<name>_value`` (``kivi2``: per-channel
keys, per-token values), or ``k<spec>v<spec>``, each spec a registered name or a bit width of ``BITS_ALIAS``
(``k8v4`` = keys ``q8_0``, values ``q4_0``; ``kq8_0vturbo3``).  The modifiers, each at most once, in any order:

* keys' statistics (:class:`~niah.kv.methods.affine.KeyAffine`): ``+centred`` takes out the per-channel key mean,
  ``+scaled`` divides by the per-channel scale, ``+static`` takes both from a per-model calibration
  (:mod:`niah.experiments.keystats`) instead of each prompt;
* raw tokens: ``+sink<N>`` keeps the first ``N`` tokens of keys and values raw (:class:`~niah.kv.methods.sink.Sink`),
  ``+recent<N>`` the newest ``N`` (the cache's residual window, as KIVI);
* one side: ``+keys`` / ``+values`` store only that side with the method, the other at fp16;
* layers (one of): ``+full`` / ``+sliding`` only that attention layer type (the policy's boundary layers still
  kept), ``+all_layers`` drops the layer policy, ``+layers=<i>[,<j>...]`` stores those decoder layers only.

``@strict`` (the default) quantizes every read; ``@engine`` reads as vLLM does (:mod:`niah.kv.cache`).  A method's
:class:`LayerPolicy` says which attention layers it stores; the others are kept at fp16.  See docs/kv-methods.md and
docs/design-notes.md#niah.kv.registry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

from .base import KVQuantizer
from .layout import FULL, SLIDING
from .methods.affine import KeyAffine
from .methods.sink import Sink

_FACTORIES: dict[str, Callable[[], KVQuantizer]] = {}
BITS_ALIAS = {"16": "fp16", "8": "q8_0", "4": "q4_0"}
READ_MODES = ("strict", "engine")
MODIFIERS = ("centred", "scaled", "static", "keys", "values", "full", "sliding", "all_layers")
NUMBERED = {"sink": r"sink(\d+)", "recent": r"recent(\d+)", "layers": r"layers=(\d+(?:,\d+)*)"}  # kind: pattern
MODIFIER_GROUPS = (("keys", "values"), ("full", "sliding", "all_layers", "layers"))  # at most one of each group


@dataclass(frozen=True)
class LayerPolicy:
    """Which attention layers a method stores (the others are kept at fp16).

    ``boundary``: the first and last ``min(boundary, layers // 2)`` decoder layers are kept, on models without
    linear-attention layers only (vLLM's ``get_boundary_skip_layers`` protects dense models and skips nothing on
    hybrid ones); ``full``, ``sliding``: whether layers of that type are stored."""

    boundary: int = 0
    full: bool = True
    sliding: bool = True
    only: tuple[int, ...] = ()  # when given, these decoder layers and no others (``+layers=5,11``)

    def stores(self, layer_idx: int, kind: str, layers: int, hybrid: bool) -> bool:
        """Whether decoder layer ``layer_idx`` of type ``kind`` (of ``layers``; ``hybrid``: the model has
        linear-attention layers) is stored with the method."""
        if self.only:
            return layer_idx in self.only
        if (kind == FULL and not self.full) or (kind == SLIDING and not self.sliding):
            return False
        n = 0 if hybrid else min(self.boundary, layers // 2)
        return not (layer_idx < n or layer_idx >= layers - n)

    def describe(self) -> str:
        if self.only:
            return f"decoder layers {', '.join(map(str, self.only))} only (the others kept at fp16)"
        kept = [f"first and last {self.boundary} layers (dense models)"] if self.boundary else []
        kept += [f"{k} layers" for k, on in (("full-attention", self.full), ("sliding-window", self.sliding)) if not on]
        return "every attention layer" if not kept else "all but " + ", ".join(kept) + " (kept at fp16)"


_POLICIES: dict[str, LayerPolicy] = {}


def set_policy(name: str, policy: LayerPolicy) -> None:
    """The layer policy of method ``name`` (default: every attention layer)."""
    _POLICIES[name] = policy


def register(name: str):
    """Decorator: ``@register("q8_0")`` on a zero-argument factory or a dataclass with defaults."""

    def wrap(factory):
        if name in _FACTORIES:
            raise ValueError(f"KV method {name!r} is registered twice")
        _FACTORIES[name] = factory
        return factory

    return wrap


def available() -> list[str]:
    """All method names, sorted (``kivi2`` for the pair ``kivi2_key``/``kivi2_value``)."""
    _load_builtin()
    return sorted({re.sub(r"_(key|value)$", "", n) for n in _FACTORIES})


@dataclass
class KVMethod:
    """A key quantizer and a value quantizer, under one name."""

    name: str
    key: KVQuantizer
    value: KVQuantizer
    layers: LayerPolicy = field(default_factory=LayerPolicy)
    read_mode: str = "strict"
    recent: int = 0  # ``+recent<N>``: the newest tokens kept raw, besides what the quantizers keep

    @property
    def residual(self) -> int:
        return max(self.key.residual, self.value.residual, self.recent)

    @property
    def key_statistics(self) -> KeyAffine | None:
        """The key wrapper that takes out per-channel statistics (``+centred``, ``+scaled``), if any."""
        k = self.key.inner if isinstance(self.key, Sink) else self.key
        return k if isinstance(k, KeyAffine) else None

    @property
    def token_group(self) -> int:
        return max(self.key.token_group, self.value.token_group)

    def analytical_bits(self, head_dim: int) -> float:
        """Mean of key and value bits per value."""
        return (self.key.analytical_bits(head_dim) + self.value.analytical_bits(head_dim)) / 2

    def check_head_dim(self, head_dim: int) -> None:
        self.key.check_head_dim(head_dim)
        self.value.check_head_dim(head_dim)


def _one(name: str, whole: str) -> KVQuantizer:
    name = BITS_ALIAS.get(name, name)
    if name not in _FACTORIES and f"{name}_key" in _FACTORIES:
        raise ValueError(f"{name!r} treats keys and values differently and cannot be used for one side of {whole!r}")
    if name not in _FACTORIES:
        raise ValueError(
            f"unknown KV method {whole!r}: choose one of {', '.join(available())}, "
            f"or k<key>v<value> with those names or bit widths {sorted(BITS_ALIAS)} (e.g. k8v4)"
        )
    return _FACTORIES[name]()


def get_method(name: str) -> KVMethod:
    """``get_method("q8_0")``, ``get_method("k8v4")``, ``get_method("turboquant_k3v4_nc+centred@engine")``; an unknown
    name, modifier or read mode raises ``ValueError`` listing the choices."""
    _load_builtin()
    spec, _, mode = name.partition("@")
    if mode and mode not in READ_MODES:
        raise ValueError(f"unknown read mode {mode!r} in KV method {name!r}: choose {' or '.join(READ_MODES)}")
    core, *mods = spec.split("+")
    kinds = [_kind(m) for m in mods]
    if None in kinds or len(set(kinds)) < len(kinds) or any(len(set(g) & set(kinds)) > 1 for g in MODIFIER_GROUPS):
        raise ValueError(
            f"bad modifiers {mods} in KV method {name!r}: each of {', '.join(MODIFIERS)}, sink<N>, recent<N> and "
            "layers=<i>[,<j>] at most once; keys or values; one of full, sliding, all_layers, layers="
        )
    if "static" in kinds and not {"centred", "scaled"} & set(kinds):
        raise ValueError(f"{name!r}: +static calibrates the statistics of +centred or +scaled: add one of them")
    m = _core_method(core)
    m = replace(m, name=name, layers=_POLICIES.get(core, LayerPolicy()), read_mode=mode or "strict")
    return _modified(m, dict(zip(kinds, mods)))


def _kind(mod: str) -> str | None:
    """The modifier's kind (``"sink"`` for ``sink4``), None if it is none."""
    if mod in MODIFIERS:
        return mod
    return next((kind for kind, pattern in NUMBERED.items() if re.fullmatch(pattern, mod)), None)


def _number(mods: dict[str, str], kind: str) -> str | None:
    return re.fullmatch(NUMBERED[kind], mods[kind]).group(1) if kind in mods else None


def with_modifier(name: str, mod: str) -> str | None:
    """``name`` with the modifier ``mod`` added before its read mode (``"turboquant_k8v4@engine"``, ``"keys"`` ->
    ``"turboquant_k8v4+keys@engine"``); ``None`` when ``name`` already has ``mod`` or another of its group."""
    spec, at, mode = name.partition("@")
    kinds, kind = {_kind(m) for m in spec.split("+")[1:]}, _kind(mod)
    group = next((g for g in MODIFIER_GROUPS if kind in g), (kind,))
    return None if kinds & set(group) else f"{spec}+{mod}{at}{mode}"


def _modified(m: KVMethod, mods: dict[str, str]) -> KVMethod:
    """``m`` with the modifiers ``mods`` ({kind: as written}); the order they were written in does not matter."""
    key, value, fp16 = m.key, m.value, _FACTORIES["fp16"]()
    if {"centred", "scaled"} & set(mods):
        key = KeyAffine(key, centre="centred" in mods, scale="scaled" in mods, static="static" in mods)
    if "sink" in mods:  # outermost: the sink's outlier keys stay out of the statistics
        n = int(_number(mods, "sink"))
        key, value = Sink(key, n), Sink(value, n)
    if "keys" in mods or "values" in mods:
        key, value = (key, fp16) if "keys" in mods else (fp16, value)
    layers = m.layers
    if "all_layers" in mods:
        layers = LayerPolicy()
    elif "layers" in mods:
        layers = LayerPolicy(only=tuple(sorted({int(i) for i in _number(mods, "layers").split(",")})))
    elif "full" in mods or "sliding" in mods:
        layers = replace(layers, full="full" in mods, sliding="sliding" in mods)
    return replace(m, key=key, value=value, layers=layers, recent=int(_number(mods, "recent") or 0))


def _core_method(name: str) -> KVMethod:
    if name in _FACTORIES:
        return KVMethod(name, _FACTORIES[name](), _FACTORIES[name]())
    if f"{name}_key" in _FACTORIES:
        return KVMethod(name, _FACTORIES[f"{name}_key"](), _FACTORIES[f"{name}_value"]())
    m = re.fullmatch(r"k(.+?)v(.+)", name)
    if m and not name.startswith("kivi"):  # an unknown kivi name (kivi3) is not k"i"v"i3"
        return KVMethod(name, _one(m.group(1), name), _one(m.group(2), name))
    _one(name, name)  # raises with the list of choices
    raise AssertionError("unreachable")


def _load_builtin() -> None:
    """Import the modules whose ``@register`` calls add the built-in methods."""
    # cycle: each of these modules imports this registry at its top, for @register
    from .methods import (  # noqa: F401
        fp4,
        fp8,
        fp16,
        int8,
        kivi,
        q4_0,
        q8_0,
        sliding_window,
        turbo_mse,
        turbo_prod,
        turbo_split,
        turboquant_vllm,
    )
