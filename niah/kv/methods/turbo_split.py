"""TurboQuant with two channel groups at different bit widths: ``turbo2.5``, ``turbo3.5`` (arXiv 2504.19874, Section
4.3: outlier channels get more bits than the rest).

Half the channels (``d/2``) are coded at ``b+1`` bits and half at ``b``: ``turbo2.5`` = ``d/2`` at 3 bits + ``d/2``
at 2, ``turbo3.5`` = ``d/2`` at 4 + ``d/2`` at 3.  The outliers are, per (batch, KV head), the ``d/2`` channels (in
the original, un-rotated basis) with the largest RMS over the tokens of the layer's first stored block (ties to the
lower channel index), kept for every later block of the layer (:meth:`quantize_after`).  Each group has its own
rotation (of dimension ``d/2``), codebook and fp16 norm, so ``analytical_bits = b + 0.5 + 32/d``; the channel mask
is counted in each block's ``nbytes`` but not in ``analytical_bits``.

Stored: ``outlier_mask: uint8 (B, H, d/8)`` (shared by the layer's blocks), and per half ``codes_hi``,
``codes_lo``: uint8 ``(B, H, T, (d/2) * bits / 8)`` (bit planes) and ``norm_hi``, ``norm_lo``: fp16 ``(B, H, T)``.
Rotations, codebooks and reads: :mod:`.turbo_base`; the outlier ranking's numba pass is here with the format.
Why this split and this outlier rule: docs/design-notes.md#niah.kv.methods.turbo_split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from ..base import Packed
from ..kernels import rowkernels
from ..packing import pack_bits, unpack_bits
from ..registry import register
from .turbo_base import _CodeBlock, _layer_matrices, _mse_encode, _mse_stage, _norm16, _Turbo


def _channel_squares(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, d)`` float32: each channel's sum of squares over the tokens of ``x: (B, H, T, d)`` (ranks channels
    as their RMS does).  On the CPU one numba pass that reads ``x`` once (torch's ``square().mean(-2)`` writes a
    squared copy, and is slower for that)."""
    if not rowkernels.usable(x):
        return x.float().square().sum(dim=-2)
    b, h, t, d = x.shape
    out = np.zeros((b * h, d), np.float32)
    _column_squares(rowkernels.rows(x.float()), t, out)
    return torch.from_numpy(out).view(b, h, d)


@njit(fastmath={"reassoc", "nsz"}, boundscheck=False, nogil=True)
def _column_squares(x, tokens, out):
    """``out[g, j] += sum of x[r, j]^2`` over the ``tokens`` rows ``r`` of each group ``g`` (a (batch, head))."""
    for g in range(out.shape[0]):
        for r in range(g * tokens, (g + 1) * tokens):
            for j in range(x.shape[1]):
                out[g, j] += x[r, j] * x[r, j]


@functools.lru_cache(maxsize=128)
def _split_basis(
    seed: int, layer_idx: int, packed_mask: bytes, shape: tuple[int, int, int], device: str
) -> torch.Tensor:
    """``(B, H, d, d)`` float32: the outlier half's and then the regular half's own ``d/2``-dim rotations, each
    placed in the columns of its channels (ascending), for the outlier mask whose :func:`pack_bits` bytes are
    ``packed_mask`` (``shape = (B, H, d)``).  ``Pi x`` rotates each half of ``x``, and ``Pi^T`` puts each back in its
    channels, so neither quantize nor reads gather or scatter channels.  Made once per layer and mask, not at
    every read: made per read, it dominated a one-token chunk's scores."""
    b, h, d = shape
    k = d // 2
    mask = unpack_bits(torch.frombuffer(bytearray(packed_mask), dtype=torch.uint8).view(b, h, -1), 1, d)
    order = torch.argsort(1 - mask.to(torch.int8), dim=-1, stable=True)  # outliers first, each half ascending
    halves = []
    for part, channels in (("hi", order[..., :k]), ("lo", order[..., k:])):
        rot = _layer_matrices(f"rot_{part}", seed, layer_idx, k, h, "cpu").expand(b, h, k, k)
        halves.append(torch.zeros(b, h, k, d).scatter_(-1, channels.unsqueeze(-2).expand(b, h, k, k), rot))
    return torch.cat(halves, dim=-2).to(device)


@dataclass
class TurboQuantSplit(_Turbo):
    """Fractional bits: the ``d/2`` highest-RMS channels at ``bits_hi``, the rest at ``bits_lo`` (MSE variant)."""

    name: str = "turbo2.5"
    bits_hi: int = 3
    bits_lo: int = 2
    tokenwise = True  # given the layer's outlier channels

    def analytical_bits(self, head_dim: int) -> float:
        return (self.bits_hi + self.bits_lo) / 2 + 32 / head_dim

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < 16 or head_dim % 16:
            raise ValueError(
                f"{self.name}: head_dim must be a multiple of 16 (two channel halves, each a multiple of 8 so "
                f"codes pack into whole bytes); got head_dim={head_dim}"
            )

    def _basis(self, packed_mask: torch.Tensor, d: int) -> torch.Tensor:
        """:func:`_split_basis` for ``packed_mask: uint8 (B, H, d/8)`` (the stored outlier mask) in this layer."""
        b, h, _ = packed_mask.shape
        key = packed_mask.cpu().numpy().tobytes()
        return _split_basis(self.seed, self.layer_idx, key, (b, h, d), str(packed_mask.device))

    @property
    def _parts(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """``(part, bits)`` of the outlier half (``"hi"``, the first ``d/2`` rows of the basis) and the regular
        half (``"lo"``)."""
        return ("hi", self.bits_hi), ("lo", self.bits_lo)

    def quantize(self, x: torch.Tensor) -> Packed:
        self._check(x)
        b, h, t, d = x.shape
        top = torch.argsort(_channel_squares(x), dim=-1, descending=True, stable=True)[..., : d // 2]
        mask = torch.zeros(b, h, d, dtype=torch.uint8, device=x.device).scatter_(-1, top, 1)
        return self._packed(x, pack_bits(mask, 1))

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        self._check(x)
        return self._packed(x, prev.tensors["outlier_mask"])

    def _packed(self, x: torch.Tensor, packed_mask: torch.Tensor) -> Packed:
        """``x`` coded with the outlier channels of ``packed_mask: uint8 (B, H, d/8)``."""
        tensors = {"outlier_mask": packed_mask}
        coded = _mse_encode(x, self._basis(packed_mask, x.shape[-1]), tuple(bits for _, bits in self._parts))
        for (part, _), (codes, norm) in zip(self._parts, coded):
            tensors[f"codes_{part}"], tensors[f"norm_{part}"] = codes, _norm16(norm)
        return Packed(tensors, tuple(x.shape), x.dtype, {"method": self.name, "shared": ("outlier_mask",)})

    def _block(self, p: Packed) -> _CodeBlock:
        """A stage per half, the outliers' first, with their rotations stacked: ``(B, H, d, d)``."""
        t, k = p.tensors, p.shape[-1] // 2
        basis = self._basis(t["outlier_mask"], p.shape[-1])
        stages = tuple(_mse_stage(t[f"codes_{part}"], t[f"norm_{part}"], bits, k) for part, bits in self._parts)
        return _CodeBlock(stages, basis)


register("turbo2.5")(lambda: TurboQuantSplit("turbo2.5", bits_hi=3, bits_lo=2))
register("turbo3.5")(lambda: TurboQuantSplit("turbo3.5", bits_hi=4, bits_lo=3))
