"""``TurboQuant_mse`` (Algorithm 1 of arXiv 2504.19874): ``turbo2``, ``turbo3``, ``turbo4``.

``b`` bits per coordinate.  Stored per token and head: ``d`` codes of ``b`` bits and one fp16 norm, so
``analytical_bits = b + 16/d``: ``codes: uint8 (B, H, T, d * b / 8)`` (bit planes) and ``norm: fp16 (B, H, T)``.
Rotations, codebooks and reads: :mod:`.turbo_base`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Packed
from ..registry import register
from .turbo_base import _CodeBlock, _mse_encode, _norm16, _Turbo


@dataclass
class TurboQuantMSE(_Turbo):
    """``TurboQuant_mse`` at ``bits`` bits per coordinate (Algorithm 1)."""

    name: str = "turbo3"
    bits: int = 3
    tokenwise = True

    def analytical_bits(self, head_dim: int) -> float:
        return self.bits + 16 / head_dim

    def quantize(self, x: torch.Tensor) -> Packed:
        self._check(x)
        b, h, t, d = x.shape
        [(codes, norm)] = _mse_encode(x, self._matrices("rot", d, h, x.device), (self.bits,))
        tensors = {"codes": codes, "norm": _norm16(norm)}
        return Packed(tensors, tuple(x.shape), x.dtype, {"method": self.name})

    def _block(self, p: Packed) -> _CodeBlock:
        codes = p.tensors["codes"]
        return _CodeBlock.mse(
            codes, p.tensors["norm"], self.bits, self._matrices("rot", p.shape[-1], p.shape[1], codes.device)
        )


for _b in (2, 3, 4):
    register(f"turbo{_b}")(lambda b=_b: TurboQuantMSE(f"turbo{b}", bits=b))
