"""llama.cpp ``Q4_0`` (4.5 bits per value): blocks of 32 values along head_dim, ``d = m / -8`` where ``m`` is the
block's value of largest magnitude (sign kept), 4-bit codes ``min(15, trunc(x / d + 8.5))``, packed as ggml does.
Bit-exact with ``gguf.quants``.

Stored: ``codes: uint8 (B, H, T, D/2)``, ``scales: fp16 (B, H, T, D/32)``.  The CPU encoder (numba, one pass over
the rows) is here with the format, as are its row decoder and the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ..base import Packed
from ..kernels import rowkernels
from ..registry import register
from .blocks import BLOCK, _HeadBlocks, _inverse, _small_codes


def _q4_0_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q4_0 ``codes: uint8 (B, H, T, D/2)`` (ggml nibble order), ``scales: fp16 (B, H, T, D/32)`` -> float32
    ``(B, H, T, D/32, 2, 16)``: per block, values 0-15 from the low nibbles and 16-31 from the high ones."""
    shifts = torch.tensor([[0], [4]], dtype=torch.int32, device=codes.device)
    nibbles = codes.unflatten(-1, (-1, 1, BLOCK // 2)).to(torch.int32) >> shifts & 15
    return (nibbles - 8).float() * scales.float()[..., None, None]


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """``(..., 1)``: the first value of largest magnitude along the last dim, sign kept (numpy's argmax rule).

    Computed from max and min; only blocks where ``max == -min`` (a tie in magnitude, or all zeros, where the
    sign of the zero matters for the fp16 scale) need the position.
    """
    hi, lo = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    m = torch.maximum(hi, -lo).copysign_(hi + lo)  # the sign of hi + lo says which side is larger
    tie = (hi == -lo).squeeze(-1)
    if tie.any():
        tied = blocks[tie]
        m[tie] = tied.gather(-1, tied.abs().argmax(-1, keepdim=True))
    return m


@dataclass
class Q4_0(_HeadBlocks):
    """llama.cpp ``Q4_0``.  Stored: ``codes: uint8 (B, H, T, D/2)``, ``scales: fp16 (B, H, T, D/32)``.

    ``d = m / -8`` with ``m`` the first value of largest ``|x|`` in the block, codes
    ``min(15, trunc(x * (1/d) + 8.5))`` in float32 (so ``m`` itself gets code 0 and values of the opposite
    sign reach at most ``7 d``), scale rounded to fp16 after.  Bytes as in ggml's ``block_q4_0``: byte ``j`` of a
    block holds value ``j`` in its low nibble and value ``j + 16`` in its high nibble.
    """

    name: str = "q4_0"
    code_bits = 4

    def quantize(self, x: torch.Tensor) -> Packed:
        blocks = self._blocks(x)
        if rowkernels.usable(blocks):
            codes = torch.empty(*x.shape[:-1], x.shape[-1] // 2, dtype=torch.uint8)
            scales = torch.empty(*x.shape[:-1], x.shape[-1] // BLOCK)
            _q4_0_encode_rows(
                rowkernels.rows(blocks.flatten(-2)),
                codes.view(-1, codes.shape[-1]).numpy(),
                scales.view(-1, scales.shape[-1]).numpy(),
            )
            return Packed({"codes": codes, "scales": scales.half()}, tuple(x.shape), x.dtype)
        d = _signed_absmax(blocks) / -8
        codes = _small_codes((blocks * _inverse(d)).add_(8.5)).clamp_max_(15)
        # ggml nibbles: byte j = code j | code j+16 << 4.  Every code is < 16, so shifting the 64-bit words of the
        # second half-block by 4 moves each of its codes into the high nibble of its own byte.
        halves = codes.view(torch.int64).unflatten(-1, (2, -1))  # (B, H, T, D/32, 2, 2): 16 codes per half
        packed = (halves[..., 0, :] | halves[..., 1, :] << 4).view(torch.uint8)
        return Packed({"codes": packed.flatten(-2), "scales": d.squeeze(-1).half()}, tuple(x.shape), x.dtype)

    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        return _q4_0_decode(p.tensors["codes"], p.tensors["scales"]).flatten(-3).to(p.dtype)

    @staticmethod
    @njit(**rowkernels.DECODER)
    def decode_row(stored, r, out):
        codes, scales = stored
        for blk in range(scales.shape[1]):
            d = scales[r, blk]
            w0, w1, w2, w3 = rowkernels.plane_words(codes, r, blk, 4, 32)  # the block's 16 bytes
            for j in range(32):  # value j: low nibble of byte j, or high nibble of byte j - 16
                code = rowkernels.nibble(w0, w1, w2, w3, (j & 15) << 1 | j >> 4)
                out[blk * 32 + j] = np.float32(np.int32(code) - 8) * d


@njit(boundscheck=False, nogil=True)  # no fastmath: ggml's float32 arithmetic, bit for bit
def _q4_0_encode_rows(x, codes, scales):
    """q4_0 on the CPU in one pass: ``x: float32 (R, D)`` -> ``codes: uint8 (R, D/2)``, ``scales: float32
    (R, D/32)``, the numbers of the torch path of :meth:`Q4_0.quantize`.  Blocks go two at a time: one loop of
    64 lanes, each with its block's ``1/d``, computes the codes, which LLVM vectorizes (a 16-lane loop per block
    was slower); an odd last block goes alone."""
    c = np.empty(2 * BLOCK, np.int32)
    blocks = scales.shape[1]
    for r in range(x.shape[0]):
        for pair in range(blocks // 2):
            inv0, inv1 = _q4_0_scale(x, r, 2 * pair, scales), _q4_0_scale(x, r, 2 * pair + 1, scales)
            for i in range(2 * BLOCK):
                c[i] = _q4_0_code(x[r, 2 * BLOCK * pair + i], inv1 if i & BLOCK else inv0)
            for i in range(BLOCK // 2):  # ggml nibbles: byte j = code j | code j + 16 << 4
                codes[r, BLOCK * pair + i] = np.uint8(c[i] | c[i + 16] << 4)
                codes[r, BLOCK * pair + 16 + i] = np.uint8(c[BLOCK + i] | c[BLOCK + 16 + i] << 4)
        if blocks % 2:
            last = blocks - 1
            inv = _q4_0_scale(x, r, last, scales)
            for i in range(BLOCK):
                c[i] = _q4_0_code(x[r, BLOCK * last + i], inv)
            for i in range(BLOCK // 2):
                codes[r, 16 * last + i] = np.uint8(c[i] | c[i + 16] << 4)


@njit(boundscheck=False, nogil=True, inline="always")
def _q4_0_code(v, inv):
    """ggml's q4_0 code of ``v`` for ``1/d = inv``: ``min(15, trunc(v * inv + 8.5))``, int32."""
    return min(np.int32(15), np.int32(v * inv + np.float32(8.5)))


@njit(boundscheck=False, nogil=True, inline="always")
def _q4_0_scale(x, r, blk, scales):
    """Writes block ``blk``'s ``d = m / -8`` (``m``: the first value of largest ``|x|``, as in ggml; starting from
    the block's first value keeps the sign of an all-zero block's zero) and returns ``1/d`` (0 where ``d = 0``)."""
    base = blk * BLOCK
    m = x[r, base]
    for i in range(base + 1, base + BLOCK):
        if abs(x[r, i]) > abs(m):
            m = x[r, i]
    d = m / np.float32(-8.0)
    scales[r, blk] = d
    return np.float32(1.0) / d if d != 0 else np.float32(0.0)


register("q4_0")(Q4_0)
