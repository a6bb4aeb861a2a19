"""Full-precision reference storage: ``fp16`` and ``bf16`` (a plain cast, 16 bits per value)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import KVQuantizer, Packed, check_kv_shape
from ..registry import register


@dataclass
class CastStorage(KVQuantizer):
    """Stores ``x`` cast to ``storage_dtype``; dequantize casts back to the input dtype."""

    name: str = "fp16"
    storage_dtype: torch.dtype = torch.float16
    tokenwise = True

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        return Packed({"values": x.to(self.storage_dtype)}, tuple(x.shape), x.dtype)

    def dequantize(self, p: Packed) -> torch.Tensor:
        return p.tensors["values"].to(p.dtype)

    def analytical_bits(self, head_dim: int) -> float:
        return float(torch.finfo(self.storage_dtype).bits)


register("fp16")(lambda: CastStorage("fp16", torch.float16))
register("bf16")(lambda: CastStorage("bf16", torch.bfloat16))
