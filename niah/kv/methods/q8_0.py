"""llama.cpp ``Q8_0`` (8.5 bits per value): blocks of 32 values along head_dim, one fp16 scale ``d = absmax / 127``
and int8 codes ``round(x / d)``.  Bit-exact with ``gguf.quants`` (see the tests).

Stored: ``codes: int8 (B, H, T, D)``, ``scales: fp16 (B, H, T, D/32)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from numba import njit

from ..attend import fused_or_eager
from ..base import Packed
from ..kernels import rowkernels
from ..registry import register
from .blocks import BLOCK, _HeadBlocks, _inverse


def _q8_values(codes: torch.Tensor) -> torch.Tensor:
    """q8_0 ``codes: int8 (B, H, T, D)`` -> float32 ``(B, H, T, D/32, 32)``."""
    return codes.unflatten(-1, (-1, BLOCK)).float()


def _q8_0_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks: float32 (B, H, T, D/32, 32)`` -> q8_0 ``codes: int8 (B, H, T, D)``,
    ``scales: fp16 (B, H, T, D/32)``."""
    a = blocks.abs()
    d = a.amax(-1, keepdim=True) / 127
    # roundf(x * (1/d)) = sign(x) * trunc(|x| * (1/d) + (0.5 - 2**-25)): adding the float32 just below 0.5 is
    # exact or rounds the right way for every float32 (adding 0.5 itself would send 0.49999997 to 1)
    codes = a.mul_(_inverse(d)).add_(0.5 - 2**-25).copysign_(blocks).to(torch.int8)
    return codes.flatten(-2), d.squeeze(-1).half()


@dataclass
class Q8_0(_HeadBlocks):
    """llama.cpp ``Q8_0``.  Stored: ``codes: int8 (B, H, T, D)``, ``scales: fp16 (B, H, T, D/32)``.

    As in ggml (and ``gguf.quants``), codes are ``roundf(x * (1/d))`` with the float32 ``d = absmax / 127``
    (ties away from zero); only the stored scale is rounded to fp16 afterwards, and dequantize uses that fp16
    scale.  A block with ``absmax / 127`` beyond the fp16 range gets an infinite scale, as in ggml.
    """

    name: str = "q8_0"
    code_bits = 8

    def quantize(self, x: torch.Tensor) -> Packed:
        codes, scales = fused_or_eager(_q8_0_encode, self._blocks(x), tokens=x.shape[-2])
        return Packed({"codes": codes, "scales": scales}, tuple(x.shape), x.dtype)

    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        return self._scaled(_q8_values(p.tensors["codes"]), p)

    def decoder(self, p: Packed):
        return _q8_0_block_pairs if p.shape[-1] % (2 * BLOCK) == 0 else self.decode_row

    @staticmethod
    @njit(**rowkernels.DECODER)
    def decode_row(stored, r, out):
        codes, scales = stored
        for blk in range(scales.shape[1]):
            d = scales[r, blk]  # loaded once per block: ``out`` might alias ``scales`` for all numba knows
            for i in range(blk * 32, blk * 32 + 32):  # unrolled into scalar code (see rowkernels)
                out[i] = codes[r, i] * d


@njit(**rowkernels.DECODER)
def _q8_0_block_pairs(stored, r, out):
    """:meth:`Q8_0.decode_row` for an even number of blocks per row: one loop of 64 lanes per two blocks, each
    lane picking its block's scale, which LLVM vectorizes (a 32-value loop per block it unrolls into scalars,
    and that made the scores slower)."""
    codes, scales = stored
    for pair in range(scales.shape[1] // 2):
        d0, d1 = scales[r, 2 * pair], scales[r, 2 * pair + 1]
        for i in range(64):
            out[64 * pair + i] = codes[r, 64 * pair + i] * (d1 if i & 32 else d0)


register("q8_0")(Q8_0)
