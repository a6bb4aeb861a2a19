"""Scalar KV-cache quantizers: llama.cpp block formats, fp8/fp4 floats, KIVI, and the seed's sliding window.

Registered methods (bits per value from the format; ``D`` = head_dim)
--------------------------------------------------------------------
``q8_0``  (8.5)
    llama.cpp ``Q8_0``: blocks of 32 values along head_dim, one fp16 scale ``d = absmax / 127`` and int8
    codes ``round(x / d)``.  Bit-exact with ``gguf.quants`` (see the tests).
``q4_0``  (4.5)
    llama.cpp ``Q4_0``: blocks of 32, ``d = m / -8`` where ``m`` is the block's value of largest magnitude (sign
    kept), 4-bit codes ``min(15, trunc(x / d + 8.5))``, packed as ggml does.  Bit-exact with ``gguf.quants``.
``fp8_e4m3``, ``fp8_e5m2``  (8)
    float8 codes and one fp32 scale per (batch, KV head), taken from the layer's first stored chunk.
``fp4_e2m1``  (4.5)
    1 sign, 2 exponent, 1 mantissa bit per value, one fp16 scale per block of 32.
``kivi2_key``, ``kivi2_value``, ``kivi4_key``, ``kivi4_value``  (3 and 5)
    KIVI (Liu et al., arXiv 2402.02750): asymmetric min/max, fp16 scale and zero point per group of 32; keys
    per channel (groups of 32 tokens), values per token (groups of 32 channels); the newest 128 tokens stay in
    full precision (``residual = 128``, kept by the cache).
``sliding_window_asym3``  (3.0625)
    The seed article's quantizer: 3-bit asymmetric min/max per channel over windows of 512 tokens.

All of them compute in float32 and ``dequantize`` returns the input dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from numba import njit

from . import rowkernels
from .attend import fused_or_eager
from .base import Packed, RowDecoded, check_kv_shape
from .packing import pack_bits, pack_planes, plane_run, unpack_bits, unpack_planes
from .registry import register

BLOCK = 32  # values per scale along head_dim (llama.cpp QK8_0 = QK4_0 = 32; KIVI's group size)

# Speed notes (CPU, one thread): reads on the CPU go through each format's numba ``decode_row``
# (:mod:`niah.kv.rowkernels`); the torch paths below serve other devices.  In them, fresh full-size tensors cost
# page faults, so each method allocates one float32 working tensor and updates it in place; float -> uint8
# casts are much slower than float -> int8, so small codes go through int8; e4m3 -> float32 casts are slow, so
# its bits are moved by hand (_fp8_float).  Measure with ``python -m niah bench kv``.


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, and 0 where ``d == 0`` (an all-zero block then gets code 0, as in ggml)."""
    return torch.where(d == 0, 0.0, 1.0 / d)


def _small_codes(v: torch.Tensor) -> torch.Tensor:
    """Float ``v`` with values in ``[0, 127]`` -> uint8 codes, truncated toward zero (through int8, the fast cast)."""
    return v.to(torch.int8).view(torch.uint8)


def _check_blocks(name: str, head_dim: int, block: int) -> None:
    if head_dim % block:
        raise ValueError(
            f"{name} quantizes blocks of {block} values along head_dim, so head_dim must be a multiple of {block} "
            f"({', '.join(str(block * k) for k in range(1, 5))}, ...); got head_dim={head_dim}"
        )


def _q8_values(codes: torch.Tensor) -> torch.Tensor:
    """q8_0 ``codes: int8 (B, H, T, D)`` -> float32 ``(B, H, T, D/32, 32)``."""
    return codes.unflatten(-1, (-1, BLOCK)).float()


def _q4_0_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q4_0 ``codes: uint8 (B, H, T, D/2)`` (ggml nibble order), ``scales: fp16 (B, H, T, D/32)`` -> float32
    ``(B, H, T, D/32, 2, 16)``: per block, values 0-15 from the low nibbles and 16-31 from the high ones."""
    shifts = torch.tensor([[0], [4]], dtype=torch.int32, device=codes.device)
    nibbles = codes.unflatten(-1, (-1, 1, BLOCK // 2)).to(torch.int32) >> shifts & 15
    return (nibbles - 8).float() * scales.float()[..., None, None]


def _q8_0_encode(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks: float32 (B, H, T, D/32, 32)`` -> q8_0 ``codes: int8 (B, H, T, D)``, ``scales: fp16 (B, H, T, D/32)``."""
    a = blocks.abs()
    d = a.amax(-1, keepdim=True) / 127
    # roundf(x * (1/d)) = sign(x) * trunc(|x| * (1/d) + (0.5 - 2**-25)): adding the float32 just below 0.5 is
    # exact or rounds the right way for every float32 (adding 0.5 itself would send 0.49999997 to 1)
    codes = a.mul_(_inverse(d)).add_(0.5 - 2**-25).copysign_(blocks).to(torch.int8)
    return codes.flatten(-2), d.squeeze(-1).half()


class _HeadBlocks(RowDecoded):
    """Base for formats with ``code_bits``-bit codes and one fp16 scale per block of ``BLOCK`` values along head_dim.
    Their row decoders read ``row_args`` = ``(codes, scales)``, rows first."""

    code_bits: ClassVar[int]
    tokenwise = True  # blocks run along head_dim: each token is coded on its own

    def check_head_dim(self, head_dim: int) -> None:
        _check_blocks(self.name, head_dim, BLOCK)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, H, T, D)`` -> float32 ``(B, H, T, D/32, 32)``."""
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])
        return x.float().unflatten(-1, (-1, BLOCK))

    def analytical_bits(self, head_dim: int) -> float:
        return self.code_bits + 16 / BLOCK  # codes + one fp16 scale per block

    @staticmethod
    def _scaled(values: torch.Tensor, p: Packed) -> torch.Tensor:
        """``values``: a float32 working tensor ``(B, H, T, D/32, 32)``, scaled in place by ``scales``
        -> ``(B, H, T, D)`` in ``p.dtype``."""
        return values.mul_(p.tensors["scales"].float().unsqueeze(-1)).flatten(-2).to(p.dtype)

    def row_args(self, p: Packed) -> tuple:
        return rowkernels.rows(p.tensors["codes"]), rowkernels.rows(p.tensors["scales"])


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
                rowkernels.rows(blocks.flatten(-2)), codes.view(-1, codes.shape[-1]).numpy(), scales.view(-1, scales.shape[-1]).numpy()
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
_E2M1_PAIRS = torch.cat([_E2M1_VALUES, -_E2M1_VALUES])[unpack_bits(torch.arange(256, dtype=torch.uint8).unsqueeze(-1), 4, 2).long()]


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
                rowkernels.rows(blocks.flatten(-2)), rowkernels.rows(scale.squeeze(-1)), codes.view(-1, codes.shape[-1]).numpy()
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


@dataclass
class FP8(RowDecoded):
    """float8 codes with one fp32 scale ``absmax / finfo.max`` per (batch, KV head).

    ``fp8_e4m3`` (``torch.float8_e4m3fn``, max 448) is vLLM's default fp8 KV-cache dtype (``kv_cache_dtype="fp8"``);
    ``fp8_e5m2`` (max 57344) is the "5-bit exponent + 2-bit mantissa" format of claim S3-9.  The scale is taken
    over the tokens and head_dim of the layer's first stored chunk (the prefill) and kept for every later chunk
    (:meth:`quantize_after`), whose values beyond it saturate at ``±finfo.max``.  That is vLLM's
    ``calculate_kv_scales=True`` (absmax of the first forward pass, computed once; ``Attention.calc_kv_scales``),
    at vLLM's per-head granularity (``k/v_scale = [num_kv_heads]``, docs "Quantized KV Cache").
    Stored: ``codes: float8 (B, H, T, D)``, ``scales: fp32 (B, H)`` (shared by the chunks of a layer, counted in
    each).  ``analytical_bits`` is 8.
    """

    name: str = "fp8_e4m3"
    fp8: torch.dtype = torch.float8_e4m3fn
    tokenwise = True  # given the layer's scale

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        return self._packed(x, *fused_or_eager(_fp8_scale_and_encode, x, self.fp8, tokens=x.shape[-2]))

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        check_kv_shape(x)
        scale = prev.tensors["scales"]
        return self._packed(x, fused_or_eager(_fp8_encode, x, scale, self.fp8, tokens=x.shape[-2]), scale)

    @staticmethod
    def _packed(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> Packed:
        return Packed({"codes": codes, "scales": scale}, tuple(x.shape), x.dtype, {"shared": ("scales",)})

    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        return _fp8_decode(p.tensors["codes"], p.tensors["scales"]).to(p.dtype)

    def decoder(self, p: Packed):
        return _fp8_row(self.fp8 == torch.float8_e5m2)

    def row_args(self, p: Packed) -> tuple:
        scales = rowkernels.rows(p.tensors["scales"].reshape(-1, 1, 1))  # one per (batch, head): row r's is r // T
        return rowkernels.rows(p.tensors["codes"]), scales, p.shape[2]

    def analytical_bits(self, head_dim: int) -> float:
        return 8.0


def _fp8_scale_and_encode(x: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: (B, H, T, D)`` -> ``codes: fp8 (B, H, T, D)`` and its scale ``absmax / finfo.max``: fp32 ``(B, H)``."""
    scale = x.float().abs().amax((-2, -1)) / torch.finfo(fp8).max
    scale = torch.where(scale == 0, 1.0, scale)  # an all-zero head: any scale gives zero codes
    return _fp8_encode(x, scale, fp8), scale


def _fp8_encode(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``x: (B, H, T, D)``, ``scale: fp32 (B, H)`` -> ``codes: fp8 (B, H, T, D)``, saturated at ``±finfo.max``
    (a later chunk may exceed the scale's absmax; e5m2's cast would give inf)."""
    big = torch.finfo(fp8).max
    return (x.float() / scale[..., None, None]).clamp_(-big, big).to(fp8)


def _fp8_float(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes -> float32, exactly.  e5m2 is the top byte of an fp16, so its cast is cheap; e4m3fn's cast is
    slow on the CPU, so its bits go into an fp16 instead: sign to bit 15, the 7 exponent and mantissa bits to bits
    7-13.  That fp16 is the e4m3 value times ``2**-8`` (the exponent bias goes from 7 to 15), subnormals included
    (``m * 2**-9`` lands on the fp16 subnormal ``m * 2**-17``).  The stored codes are never NaN."""
    if codes.dtype != torch.float8_e4m3fn:
        return codes.float()
    b = codes.view(torch.uint8).to(torch.int16)
    return ((b & 128) << 8 | (b & 127) << 7).view(torch.float16).float() * 256.0


@functools.lru_cache(maxsize=None)
def _fp8_row(e5m2: bool):
    """The row decoder of :class:`FP8` (e4m3fn, or e5m2 where ``e5m2``): each code's value built from its bits,
    exactly, and times the head's scale.  A normal code's exponent and mantissa bits go to float32's, with the
    exponent bias moved (7 or 15 to 127) by an integer add; a subnormal one (exponent 0) is ``m * 2**-9`` (e4m3) or
    ``m * 2**-16`` (e5m2); e5m2's top exponent is float32's (inf and NaN, as torch's cast; e4m3fn's NaN pattern
    0x7F decodes to 480, as :func:`_fp8_float` does: the encoder saturates and never writes it).  Selects instead
    of a 256-entry table: a table load per value made the scores slower, for the same bits.  Lanes of 32 values
    with a compile-time count, then the tail."""
    mant, bias, sub = (2, 15, np.float32(2.0**-16)) if e5m2 else (3, 7, np.float32(2.0**-9))
    rebias = np.uint32((127 - bias) << 23)

    @njit(**rowkernels.DECODER)
    def value(c):
        # every step cast back to uint32: numba widens integer arithmetic to 64 bits, halving the vector lanes
        low = np.uint32(np.uint32(c) & np.uint32(127))
        normal = np.uint32(np.uint32(low << np.uint32(23 - mant)) + rebias)
        top = np.uint32(normal | np.uint32(0x7F800000))  # float32's top exponent: inf or NaN, as e5m2's
        finite, infinite = normal.view(np.float32), top.view(np.float32)
        big = infinite if e5m2 and low >= np.uint32(124) else finite
        magnitude = np.float32(low) * sub if low < np.uint32(1 << mant) else big
        return -magnitude if np.uint32(c) >= np.uint32(128) else magnitude

    @njit(**rowkernels.DECODER)
    def decode_row(stored, r, out):
        codes, scales, tokens = stored
        d = scales[r // tokens]
        n = out.shape[0]
        for start in range(0, n - n % 32, 32):
            for j in range(32):
                out[start + j] = value(codes[r, start + j]) * d
        for i in range(n - n % 32, n):
            out[i] = value(codes[r, i]) * d

    return decode_row


def _fp8_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes: fp8 (B, H, T, D)``, ``scales: (B, H)`` -> float32 values."""
    return _fp8_float(codes) * scales[..., None, None]


def _minmax_quantize(x: torch.Tensor, bits: int, size: int, dim: int) -> dict[str, torch.Tensor]:
    """Asymmetric min/max quantization of ``x: (B, H, T, D)`` in groups of ``size`` along ``dim``.

    ``dim = -2``: groups of ``size`` consecutive tokens per channel; ``dim = -1``: groups of ``size`` channels
    per token.  A shorter last group is allowed (the tensor is padded by repeating its last slice, which leaves
    that group's min and max unchanged).  Per group: ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``,
    both fp16; codes ``clamp(round((x - zero) / scale), 0, 2**bits - 1)`` with the fp16 values.
    Returns ``codes: uint8 (B, H, T, D * bits / 8)`` in the bit planes of :func:`pack_planes` and ``scales``,
    ``zeros``: fp16, ``x``'s shape with ``dim`` reduced to ``ceil(len / size)``.
    """
    n, levels = x.shape[dim], 2**bits - 1
    groups = _pad_groups(x.float(), size, dim)
    lo, hi = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
    zero, scale = lo.half(), ((hi - lo) / levels).half()
    codes = _small_codes((groups - zero.float()).mul_(_inverse(scale.float())).round_().clamp_(0, levels))
    codes = codes.flatten(dim - 1, dim).narrow(dim, 0, n)
    return {"codes": pack_planes(codes, bits), "scales": scale.squeeze(dim), "zeros": zero.squeeze(dim)}


def _minmax_dequantize(p: Packed, bits: int, size: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`_minmax_quantize` for ``p`` -> ``(B, H, T, D)`` in ``p.dtype``."""
    t = p.tensors
    codes = unpack_planes(t["codes"], bits, p.shape[-1])
    groups = _pad_groups(codes, size, dim).float()
    x = groups.mul_(t["scales"].unsqueeze(dim).float()).add_(t["zeros"].unsqueeze(dim).float())
    return x.flatten(dim - 1, dim).narrow(dim, 0, p.shape[dim]).to(p.dtype)


@functools.lru_cache(maxsize=None)
def _minmax_row(bits: int, run: int, channel_size: int):
    """The row decoder (:mod:`niah.kv.rowkernels`) of :func:`_minmax_quantize`'s layout: ``code * scale + zero``
    (two roundings, as the torch path), the scale and zero of row ``r``'s token group (``token_size`` tokens per
    group, along dim -2; ``channel_size = 1``: a scale per channel) or channel group (``channel_size == run``
    channels, along dim -1: a scale per plane run).  Each lane shifts its code out of the run's planes and scales
    it at once.  ``bits``, the plane run and ``channel_size`` are compile-time constants, so the 32-lane loop
    vectorizes (a separate loop of 32 per channel group was unrolled into scalar code, which made KIVI-4 values'
    scores slower)."""
    if channel_size not in (1, run):
        raise ValueError(f"min/max row decoder: channel groups must be 1 or one plane run ({run}); got {channel_size}")

    @njit(**rowkernels.DECODER)
    def decode_row(stored, r, out):
        codes, scales, zeros, tokens, token_size = stored
        s = (r // tokens) * ((tokens + token_size - 1) // token_size) + (r % tokens) // token_size
        for block in range(out.shape[0] // run):
            w0, w1, w2, w3 = rowkernels.plane_words(codes, r, block, bits, run)
            if channel_size == 1:  # read per lane below
                group_scale = group_zero = np.float32(0.0)
            else:
                group_scale, group_zero = scales[s, block], zeros[s, block]
            for j in range(run):
                b0, b1, b2, b3 = rowkernels.lane_bits(w0, w1, w2, w3, j)
                code = np.float32(b0 | b1 << np.uint32(1) | b2 << np.uint32(2) | b3 << np.uint32(3))
                c = block * run + j
                if channel_size == 1:
                    out[c] = code * scales[s, c] + zeros[s, c]
                else:
                    out[c] = code * group_scale + group_zero

    return decode_row


class _MinMax(RowDecoded):
    """Base for the min/max formats (:func:`_minmax_quantize`): ``bits`` and :attr:`_groups` define them."""

    bits: int  # a field of each dataclass subclass

    @property
    def _groups(self) -> tuple[int, int]:
        """``(size, dim)`` of :func:`_minmax_quantize`."""
        raise NotImplementedError

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 8:
            raise ValueError(
                f"{self.name}: head_dim must be a multiple of 8 (codes are stored in bit planes of 8-code bytes); got head_dim={head_dim}"
            )

    def torch_dequantize(self, p: Packed) -> torch.Tensor:
        return _minmax_dequantize(p, self.bits, *self._groups)

    def decoder(self, p: Packed):
        size, dim = self._groups
        return _minmax_row(self.bits, plane_run(p.shape[-1]), size if dim == -1 else 1)

    def row_args(self, p: Packed) -> tuple:
        size, dim = self._groups
        t = {k: rowkernels.rows(v) for k, v in p.tensors.items()}
        return t["codes"], t["scales"], t["zeros"], p.shape[2], size if dim == -2 else 1

    def analytical_bits(self, head_dim: int) -> float:
        return self.bits + 32 / self._groups[0]  # codes + fp16 scale and zero per group


def _pad_groups(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` split into ``(groups, size)``, padded at the end by repeating its last slice."""
    n = x.shape[dim]
    if n % size:
        x = x.index_select(dim, torch.arange(n + -n % size, device=x.device).clamp_max_(n - 1))
    return x.unflatten(dim, (-1, size))


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


@dataclass
class SlidingWindowAsym3(_MinMax):
    """The seed article's quantizer: 3-bit asymmetric min/max with statistics over a window of 512 tokens.

    Per channel, the tokens of each stored chunk are split into consecutive windows of ``window`` tokens (the
    last one may be shorter); each (window, channel) gets an fp16 min (zero point) and fp16 scale
    ``(max - min) / 7``, and every value a 3-bit code, packed densely (bit planes, :func:`pack_planes`).
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


register("q8_0")(Q8_0)
register("q4_0")(Q4_0)
register("fp4_e2m1")(FP4E2M1)
register("fp8_e4m3")(FP8)
register("fp8_e5m2")(functools.partial(FP8, "fp8_e5m2", torch.float8_e5m2))
register("sliding_window_asym3")(SlidingWindowAsym3)
for _bits in (2, 4):
    for _role in ("key", "value"):
        register(f"kivi{_bits}_{_role}")(functools.partial(KIVI, f"kivi{_bits}_{_role}", _bits, _role))
