"""``fp4_e2m1`` (4.5 bits per value): 4-bit floats, 1 sign, 2 exponent and 1 mantissa bit per value, one fp16 scale
per block of 32 along head_dim.

Stored: ``codes: uint8 (B, H, T, D/2)`` (two codes per byte), ``scales: fp16 (B, H, T, D/32)``.  The CPU encoder
(numba) is here with the format, as are its row decoder and the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ..base import Packed
from ..kernels import rowkernels
from ..packing import pack_bits, unpack_bits
from ..registry import register
from .blocks import BLOCK, _HeadBlocks, _inverse

_E2M1_BOUNDARIES4 = (1, 3, 5, 7, 10, 14, 20)  # 4x the rounding boundaries between E2M1 magnitudes


def _e2m1_code_table() -> torch.Tensor:
    """uint8 codes for ``j = ceil(4 |y|) * sign(y) + 24``, ``j`` in ``0 .. 48`` (``|y|`` clamped to 6).

    Every rounding boundary between E2M1 magnitudes (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of 1/4,
    so ``ceil(4 |y|)`` alone decides the magnitude: the number of boundaries ``b`` with ``4b < ceil(4 |y|)``,
    i.e. ``b < |y|`` (a tie goes to the smaller magnitude).
    """
    j = torch.arange(-24, 25)
    magnitude = (torch.tensor(_E2M1_BOUNDARIES4) < j.abs().unsqueeze(-1)).sum(-1)
    return (magnitude | (j < 0) * 8).to(torch.uint8)


_E2M1_CODES = _e2m1_code_table()
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude of bit pattern 0b000 .. 0b111
# (256, 2): the values of the two codes in each byte (low nibble first), to decode a whole byte at once
_E2M1_PAIRS = torch.cat([_E2M1_VALUES, -_E2M1_VALUES])[
    unpack_bits(torch.arange(256, dtype=torch.uint8).unsqueeze(-1), 4, 2).long()
]


@njit(boundscheck=False, nogil=True)  # no fastmath: the torch path's float32 arithmetic, bit for bit
def _e2m1_encode_rows(x, scales, codes):
    """The codes of :meth:`FP4E2M1.quantize` on the CPU: ``x: float32 (R, D)``, ``scales: float32 (R, D/32)`` (the
    fp16 scales) -> ``codes: uint8 (R, D/2)``.  Per value, ``j = min(24, ceil(4 |x| / scale))`` and the
    magnitude code is the number of rounding boundaries (in quarters, :func:`_e2m1_code_table`) below ``j``,
    with the sign bit where ``x < 0`` and ``j > 0``: no table load, so the 32 lanes of a block vectorize."""
    c = np.empty(BLOCK, np.int32)
    b0, b1, b2, b3, b4, b5, b6 = _E2M1_BOUNDARIES4  # spelled out below: a loop over them was slower
    for r in range(x.shape[0]):
        for blk in range(scales.shape[1]):
            s = scales[r, blk]
            inv4 = np.float32(4.0) * (np.float32(1.0) / s if s != 0 else np.float32(0.0))
            for i in range(BLOCK):
                v = x[r, blk * BLOCK + i]
                j = min(np.float32(24.0), np.ceil(abs(v) * inv4))
                magnitude = (
                    np.int32(j > b0)
                    + np.int32(j > b1)
                    + np.int32(j > b2)
                    + np.int32(j > b3)
                    + np.int32(j > b4)
                    + np.int32(j > b5)
                    + np.int32(j > b6)
                )
                c[i] = magnitude | np.int32(v < 0 and j > 0) << 3
            for i in range(BLOCK // 2):  # pack_bits: low nibble first
                codes[r, blk * 16 + i] = np.uint8(c[2 * i] | c[2 * i + 1] << 4)


@dataclass
class FP4E2M1(_HeadBlocks):
    """4-bit float: 1 sign, 2 exponent, 1 mantissa bit (values ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}``).

    One fp16 scale ``absmax / 6`` per block of 32 along head_dim; ``x / scale`` (with the fp16 scale) is rounded
    to the nearest representable magnitude, ties toward the smaller one.  Code = sign bit (bit 3) and the E2M1
    bit pattern (bits 0-2), two codes per byte (:func:`pack_bits`, 4 bits).
    Stored: ``codes: uint8 (B, H, T, D/2)``, ``scales: fp16 (B, H, T, D/32)``.
    """

    name: str = "fp4_e2m1"
    code_bits = 4

    def quantize(self, x: torch.Tensor) -> Packed:
        blocks = self._blocks(x)
        a = blocks.abs()
        scale = (a.amax(-1, keepdim=True) / 6).half()
        if rowkernels.usable(blocks):
            codes = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8)
            _e2m1_encode_rows(
                rowkernels.rows(blocks.flatten(-2)),
                rowkernels.rows(scale.squeeze(-1)),
                codes.view(-1, codes.shape[-1]).numpy(),
            )
            return Packed({"codes": codes, "scales": scale.squeeze(-1)}, tuple(x.shape), x.dtype)
        j = a.mul_(4 * _inverse(scale.float())).ceil_().clamp_max_(24).copysign_(blocks).add_(24)
        codes = _E2M1_CODES.to(x.device).index_select(0, j.to(torch.int32).flatten()).view(x.shape)
        return Packed({"codes": pack_bits(codes, 4), "scales": scale.squeeze(-1)}, tuple(x.shape), x.dtype)

    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        packed = p.tensors["codes"]
        values = _E2M1_PAIRS.to(packed.device).index_select(0, packed.flatten().to(torch.int32))
        return self._scaled(values.view(*p.shape[:-1], -1, BLOCK), p)

    @staticmethod
    @njit(**rowkernels.DECODER)
    def decode_row(stored, r, out):
        codes, scales = stored
        for blk in range(scales.shape[1]):
            d = scales[r, blk]
            w0, w1, w2, w3 = rowkernels.plane_words(codes, r, blk, 4, 32)  # the block's 16 bytes
            for j in range(32):  # E2M1 from its bits, in quarters: 0 or 2 for exponent 0, else (2 + m) << e
                code = rowkernels.nibble(w0, w1, w2, w3, j)
                e, m = code >> 1 & 3, code & 1
                magnitude = np.float32((2 + m) << e if e else m << 1) * np.float32(0.25)
                out[blk * 32 + j] = (-magnitude if code & 8 else magnitude) * d


register("fp4_e2m1")(FP4E2M1)
