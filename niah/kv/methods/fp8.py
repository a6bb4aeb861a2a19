"""``fp8_e4m3`` and ``fp8_e5m2`` (8 bits per value): float8 codes and one fp32 scale per (batch, KV head), taken
from the layer's first stored chunk.

Stored: ``codes: float8 (B, H, T, D)``, ``scales: fp32 (B, H)``.  Computes in float32; ``dequantize`` returns the
input dtype.  e4m3 -> float32 casts are slow on the CPU, so the torch path moves its bits by hand
(:func:`_fp8_float`), and the row decoder builds each value from its bits (:func:`_fp8_row`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ..attend import fused_or_eager
from ..base import Packed, RowDecoded, check_kv_shape
from ..kernels import rowkernels
from ..registry import register


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


register("fp8_e4m3")(FP8)
register("fp8_e5m2")(functools.partial(FP8, "fp8_e5m2", torch.float8_e5m2))
