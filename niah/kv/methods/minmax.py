"""Asymmetric min/max quantization in groups along tokens or channels: the shared base of KIVI
(:mod:`.kivi`) and the seed's sliding window (:mod:`.sliding_window`).

``x: (B, H, T, D)`` is coded in groups of ``size`` consecutive tokens per channel (``dim = -2``) or ``size``
channels per token (``dim = -1``), each with an fp16 scale and zero point; codes are packed in the bit planes of
:func:`~niah.kv.packing.pack_planes` (``D`` a multiple of 8).  Computes in float32; ``dequantize`` returns the
input dtype.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

from ..base import Packed, RowDecoded
from ..kernels import rowkernels
from ..packing import pack_planes, plane_run, unpack_planes
from .blocks import _inverse, _small_codes


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
    """The row decoder (:mod:`niah.kv.kernels.rowkernels`) of :func:`_minmax_quantize`'s layout: ``code * scale + zero``
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
                f"{self.name}: head_dim must be a multiple of 8 (codes are stored in bit planes of 8-code bytes); "
                f"got head_dim={head_dim}"
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
