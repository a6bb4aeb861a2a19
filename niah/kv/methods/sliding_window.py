"""``sliding_window_asym3`` (3.0625 bits per value): the seed article's quantizer, 3-bit asymmetric min/max per
channel over windows of 512 tokens.

Stored: ``codes: uint8 (B, H, T, 3D/8)``, ``scales``, ``zeros``: fp16 ``(B, H, ceil(T/512), D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Packed, check_kv_shape
from ..registry import register
from .minmax import _MinMax, _minmax_quantize


@dataclass
class SlidingWindowAsym3(_MinMax):
    """The seed article's quantizer: 3-bit asymmetric min/max with statistics over a window of 512 tokens.

    Per channel, the tokens of each stored chunk are split into consecutive windows of ``window`` tokens (the
    last one may be shorter); each (window, channel) gets an fp16 min (zero point) and fp16 scale
    ``(max - min) / 7``, and every value a 3-bit code, packed densely (bit planes,
    :func:`~niah.kv.packing.pack_planes`).
    Stored: ``codes: uint8 (B, H, T, 3D/8)``, ``scales``, ``zeros``: fp16 ``(B, H, ceil(T/512), D)``;
    ``3 + 32/512`` bits per value for whole windows (a shorter last window costs more).

    The seed's "attention-weighted compensation" is left out: it needs attention weights, which the cache does
    not see when it stores keys and values, and the seed does not define it, so any version would be our
    invention, not the seed's method.
    """

    name: str = "sliding_window_asym3"
    bits: int = 3
    window: int = 512

    @property
    def token_group(self) -> int:
        """The cache stores whole windows: the newest (< 512) tokens wait in full precision until a window fills."""
        return self.window

    @property
    def _groups(self) -> tuple[int, int]:
        return self.window, -2

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])
        return Packed(_minmax_quantize(x, self.bits, *self._groups), tuple(x.shape), x.dtype)


register("sliding_window_asym3")(SlidingWindowAsym3)
