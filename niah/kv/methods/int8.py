"""The naive 8-bit KV cache of seed claim S1-3: int8 codes with one scale per stored vector.

Each token of each KV head (``head_dim`` values) is coded symmetrically: ``s = absmax / 127`` rounded to fp16,
``code = round(x / s)`` clamped to [-127, 127].  One outlier channel sets the step of the whole vector, which is
why finer formats exist: q8_0 keeps a scale per 32 values.  Reads dequantize with torch (no row decoder): the
method is here for its quality, not its speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import KVQuantizer, Packed, check_kv_shape
from ..registry import register


@dataclass
class Int8PerToken(KVQuantizer):
    """Symmetric int8 per stored vector: ``codes: int8 (B, H, T, D)`` and ``scale: fp16 (B, H, T)``."""

    name: str = "int8_token"
    tokenwise = True

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        scale = (x.float().abs().amax(-1, keepdim=True) / 127).to(torch.float16)
        s = scale.float()
        codes = torch.where(s > 0, x.float() / s, 0.0).round_().clamp_(-127, 127).to(torch.int8)
        return Packed({"codes": codes, "scale": scale.squeeze(-1)}, tuple(x.shape), x.dtype, {"method": self.name})

    def dequantize(self, p: Packed) -> torch.Tensor:
        return (p.tensors["codes"].float() * p.tensors["scale"].float()[..., None]).to(p.dtype)

    def analytical_bits(self, head_dim: int) -> float:
        return 8 + 16 / head_dim


register("int8_token")(Int8PerToken)
