"""vLLM's four TurboQuant KV-cache presets, as its store kernel codes them (vLLM 0.34.0).

:data:`PRESETS` gives each preset's bit widths (table: docs/presets.md).  Keys are fp8 e4m3 with no scale
(``turboquant_k8v4``) or 3- and 4-bit codes of a Sylvester Hadamard rotation against vLLM's Lloyd-Max codebook
(:func:`gaussian_codebook`) plus an fp16 norm (:class:`VllmKey`); values are min/max per token (:class:`VllmValue`).
Stored as vLLM lays out one cache slot: ``keys: uint8 (B, H, T, key_packed_size)`` = codes then norm,
``values: uint8 (B, H, T, value_packed_size)`` = codes, scale, zero.  ``head_dim`` must be a power of two of at least
16.  vLLM's layer rules are :data:`VLLM_LAYERS`; its read rules are the cache's ``engine`` read mode
(:mod:`niah.kv.cache`).

Sources, read in the vllm 0.34.0 wheel: ``vllm/model_executor/layers/quantization/turboquant/config.py``,
``.../turboquant/centroids.py``, ``vllm/v1/attention/ops/triton_turboquant_store.py`` and
``vllm/v1/attention/backends/turboquant_attn.py``.  The coding step by step, and what differs from vLLM's kernels:
docs/design-notes.md#niah.kv.methods.turboquant_vllm.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..base import KVQuantizer, Packed, check_kv_shape
from ..packing import pack_bits, unpack_bits
from ..registry import LayerPolicy, register, set_policy

FP8_MAX = 448.0  # float8_e4m3fn
# vLLM's get_boundary_skip_layers(n=2) and --kv-cache-dtype-skip-layers sliding_window
VLLM_LAYERS = LayerPolicy(boundary=2, sliding=False)
PRESETS = {  # name: (key bits, 8 = fp8; value bits; norm correction), config.py's TQ_PRESETS
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
# the same coding at bit widths vLLM has no preset for (value bits on the coded layers, 2-bit keys): not vLLM's
VARIANTS = {"turboquant_k3v8_nc": (3, 8, True), "turboquant_k2v4_nc": (2, 4, True), "turboquant_k4v8_nc": (4, 8, True)}


def key_packed_size(head_dim: int, bits: int) -> int:
    """Bytes of one stored key (vLLM's ``TurboQuantConfig.key_packed_size``): ``D`` fp8 bytes, or codes and an fp16
    norm."""
    return head_dim if bits == 8 else math.ceil(head_dim * bits / 8) + 2


def value_packed_size(head_dim: int, bits: int) -> int:
    """Bytes of one stored value (``value_packed_size``): codes, fp16 scale and fp16 zero."""
    return math.ceil(head_dim * bits / 8) + 4


@functools.lru_cache(maxsize=None)
def gaussian_codebook(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, midpoints), float32, of vLLM's Lloyd-Max codebook for one coordinate ``~ N(0, 1/dim)``.

    vLLM's solver, rewritten with numpy: start from ``2^bits`` points evenly spaced over +-3.5 sigma, outer cell
    edges at +-10.5 sigma, each cell's mass and first moment by the trapezoid rule on 200 intervals, at most 200
    iterations (stop when no centroid moves by 1e-10).  200 iterations leave it short of convergence (its 3-bit
    ``c sqrt(d)`` is 0.24498, 0.75565, 1.34318, 2.15035 against the converged 0.2451, 0.7560, 1.3439, 2.1520), and
    the codes depend on these exact midpoints, so the solver is kept as vLLM runs it."""
    levels, var = 1 << bits, 1.0 / dim
    lo, hi = -3.5 * math.sqrt(var), 3.5 * math.sqrt(var)
    c = lo + (hi - lo) * (np.arange(levels) + 0.5) / levels
    steps = np.arange(201) / 200
    for _ in range(200):
        edges = np.concatenate([[3 * lo], (c[1:] + c[:-1]) / 2, [3 * hi]])
        x = edges[:-1, None] + (edges[1:] - edges[:-1])[:, None] * steps  # (levels, 201) trapezoid nodes per cell
        pdf = np.exp(-x * x / (2 * var)) / math.sqrt(2 * math.pi * var)
        weights = np.full(201, 1.0)
        weights[[0, -1]] = 0.5
        mass, moment = (pdf * weights).sum(1), (x * pdf * weights).sum(1)  # the common factor h cancels
        new = np.where(mass > 1e-15, moment / np.maximum(mass, 1e-300), c)
        done = np.max(np.abs(new - c)) < 1e-10
        c = new
        if done:
            break
    centroids = torch.tensor(c, dtype=torch.float32)
    return centroids, (centroids[1:] + centroids[:-1]) / 2


@functools.lru_cache(maxsize=None)
def sylvester_hadamard(dim: int) -> torch.Tensor:
    """``H / sqrt(dim)``: the Sylvester Hadamard matrix (``[[H, H], [H, -H]]`` from ``[[1]]``), float32, symmetric
    and orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x: (...)`` as fp16, each value's two little-endian bytes: ``uint8 (..., 2)``."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _fp16_of(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_fp16_bytes`: ``uint8 (..., 2)`` -> float32 ``(...)``."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _check_pow2(name: str, head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(
            f"{name}: vLLM's TurboQuant rotates keys by a Sylvester Hadamard matrix, "
            "which needs head_dim a power of two of at least 16; "
            f"got head_dim={head_dim}"
        )


@dataclass
class VllmKey(KVQuantizer):
    """A preset's keys: ``bits`` 3 or 4 (Hadamard and Lloyd-Max, fp16 norm; ``norm_correction`` for ``_nc``) or 8
    (fp8 e4m3).  Stored: ``slot: uint8 (B, H, T, key_packed_size)``."""

    name: str = "turboquant_k3v4_nc_key"
    bits: int = 3
    norm_correction: bool = True
    tokenwise = True

    def check_head_dim(self, head_dim: int) -> None:
        _check_pow2(self.name, head_dim)

    def analytical_bits(self, head_dim: int) -> float:
        return 8 * key_packed_size(head_dim, self.bits) / head_dim

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])
        k = x.float()
        if self.bits == 8:
            slot = k.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        else:
            norm = torch.linalg.vector_norm(k, dim=-1, keepdim=True)
            y = (k / (norm + 1e-8)) @ sylvester_hadamard(k.shape[-1]).to(k.device)
            mids = gaussian_codebook(k.shape[-1], self.bits)[1].to(k.device)
            codes = torch.bucketize(y, mids, right=True).to(torch.uint8)
            slot = torch.cat([pack_bits(codes, self.bits), _fp16_bytes(norm[..., 0])], dim=-1)
        return Packed({"slot": slot}, tuple(x.shape), x.dtype, {"method": self.name})

    def dequantize(self, p: Packed) -> torch.Tensor:
        slot, d = p.tensors["slot"], p.shape[-1]
        if self.bits == 8:
            return slot.view(torch.float8_e4m3fn).float().to(p.dtype)
        centroids = gaussian_codebook(d, self.bits)[0].to(slot.device)
        c = centroids[unpack_bits(slot[..., :-2], self.bits, d).long()]
        if self.norm_correction:
            c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16)
        k_rot = (_fp16_of(slot[..., -2:])[..., None] * c).half().float()
        return (k_rot @ sylvester_hadamard(d).to(slot.device)).to(p.dtype)


@dataclass
class VllmValue(KVQuantizer):
    """A preset's values: ``bits``-bit min/max per token and head over all channels, round half up, fp16 scale and zero.
    Stored: ``slot: uint8 (B, H, T, value_packed_size)``."""

    name: str = "turboquant_k3v4_nc_value"
    bits: int = 4
    tokenwise = True

    def check_head_dim(self, head_dim: int) -> None:
        _check_pow2(self.name, head_dim)

    def analytical_bits(self, head_dim: int) -> float:
        return 8 * value_packed_size(head_dim, self.bits) / head_dim

    def quantize(self, x: torch.Tensor) -> Packed:
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])
        v, top = x.float(), (1 << self.bits) - 1
        lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
        scale = ((hi - lo) / top).clamp_min(1e-8)
        codes = torch.floor((v - lo) / scale + 0.5).clamp(0, top).to(torch.uint8)
        slot = torch.cat([pack_bits(codes, self.bits), _fp16_bytes(scale[..., 0]), _fp16_bytes(lo[..., 0])], dim=-1)
        return Packed({"slot": slot}, tuple(x.shape), x.dtype, {"method": self.name})

    def dequantize(self, p: Packed) -> torch.Tensor:
        slot, d = p.tensors["slot"], p.shape[-1]
        codes = unpack_bits(slot[..., :-4], self.bits, d).float()
        return (codes * _fp16_of(slot[..., -4:-2])[..., None] + _fp16_of(slot[..., -2:])[..., None]).to(p.dtype)


for _name, (_kb, _vb, _nc) in (PRESETS | VARIANTS).items():
    register(f"{_name}_key")(lambda n=_name, b=_kb, nc=_nc: VllmKey(f"{n}_key", b, nc))
    register(f"{_name}_value")(lambda n=_name, b=_vb: VllmValue(f"{n}_value", b))
    set_policy(_name, VLLM_LAYERS)
