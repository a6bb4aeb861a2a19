"""Names -> KV methods.

A method name is either a registered quantizer name used for keys and values alike
(``q8_0``, ``turbo3``), a name registered as ``<name>_key`` and ``<name>_value`` for methods that treat
keys and values differently (``kivi2``: per-channel keys, per-token values), or ``k<spec>v<spec>`` with separate key and
value settings, where each
spec is a registered name or a bare bit width that maps through ``BITS_ALIAS``
(``k8v4`` = keys ``q8_0``, values ``q4_0``; ``kq8_0vturbo3`` also works).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .base import KVQuantizer

_FACTORIES: dict[str, Callable[[], KVQuantizer]] = {}
BITS_ALIAS = {"16": "fp16", "8": "q8_0", "4": "q4_0"}


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

    @property
    def residual(self) -> int:
        return max(self.key.residual, self.value.residual)

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
    """``get_method("q8_0")``, ``get_method("k8v4")``; an unknown name raises ``ValueError`` listing the choices."""
    _load_builtin()
    if name in _FACTORIES:
        return KVMethod(name, _FACTORIES[name](), _FACTORIES[name]())
    if f"{name}_key" in _FACTORIES:
        return KVMethod(name, _FACTORIES[f"{name}_key"](), _FACTORIES[f"{name}_value"]())
    m = re.fullmatch(r"k(.+?)v(.+)", name)
    if m and not name.startswith("kivi"):
        return KVMethod(name, _one(m.group(1), name), _one(m.group(2), name))
    _one(name, name)  # raises with the list of choices
    raise AssertionError("unreachable")


def _load_builtin() -> None:
    """Import the modules whose ``@register`` calls add the built-in methods."""
    from .methods import fp4, fp8, fp16, int8, kivi, q4_0, q8_0, sliding_window, turbo_mse, turbo_prod, turbo_split  # noqa: F401
