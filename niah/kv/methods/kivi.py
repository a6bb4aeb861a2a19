"""KIVI (Liu et al., arXiv 2402.02750; 3 and 5 bits per value): asymmetric min/max, fp16 scale and zero point per
group of 32; keys per channel (groups of 32 tokens), values per token (groups of 32 channels); the newest 128
tokens stay in full precision (``residual = 128``, kept by the cache).

Registered as ``kivi2_key``, ``kivi2_value``, ``kivi4_key``, ``kivi4_value`` (the method names ``kivi2`` and
``kivi4`` pair them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..base import Packed, check_kv_shape
from ..registry import register
from .blocks import BLOCK, _check_blocks
from .minmax import _MinMax, _minmax_quantize


@dataclass
class KIVI(_MinMax):
    """KIVI (arXiv 2402.02750): ``bits``-bit asymmetric min/max, fp16 scale and zero point per group of 32.

    ``role="key"``: per channel, groups of 32 consecutive tokens (``token_group = 32``; head_dim is free).
    ``role="value"``: per token, groups of 32 channels (head_dim must be a multiple of 32).
    ``residual = 128``: the cache keeps the newest 128 tokens in full precision, as KIVI does.
    Stored: ``codes: uint8 (B, H, T, D * bits / 8)``, ``scales``, ``zeros``: fp16 ``(B, H, T/32, D)`` for keys,
    ``(B, H, T, D/32)`` for values; ``bits + 1`` bits per value either way.
    """

    name: str = "kivi2_key"
    bits: int = 2
    role: str = "key"
    residual = 128

    def __post_init__(self):
        if self.role not in ("key", "value"):
            raise ValueError(f"{self.name}: role must be 'key' or 'value'; got {self.role!r}")

    @property
    def token_group(self) -> int:
        return BLOCK if self.role == "key" else 1

    @property
    def _groups(self) -> tuple[int, int]:
        return BLOCK, -2 if self.role == "key" else -1

    def check_head_dim(self, head_dim: int) -> None:
        if self.role == "value":
            _check_blocks(self.name, head_dim, BLOCK)
        super().check_head_dim(head_dim)

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])
        if x.shape[-2] % self.token_group:
            raise ValueError(
                f"{self.name} quantizes keys per channel in groups of {BLOCK} tokens; got {x.shape[-2]} tokens "
                f"(the cache must pass whole groups: token_group = {BLOCK})"
            )
        return Packed(_minmax_quantize(x, self.bits, *self._groups), tuple(x.shape), x.dtype)


for _bits in (2, 4):
    for _role in ("key", "value"):
        register(f"kivi{_bits}_{_role}")(functools.partial(KIVI, f"kivi{_bits}_{_role}", _bits, _role))
