"""The shared base of the llama.cpp-style block formats (q8_0, q4_0, fp4_e2m1) and the torch helpers they and
the min/max formats use.

A block format stores ``code_bits``-bit codes and one fp16 scale per block of :data:`BLOCK` values along
head_dim: a chunk ``x: (B, H, T, D)`` is coded as float32 blocks ``(B, H, T, D/32, 32)``, so ``D`` must be a
multiple of 32, and every token is coded on its own.  All of them compute in float32 and ``dequantize``
returns the input dtype.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..base import Packed, RowDecoded, check_kv_shape
from ..kernels import rowkernels

BLOCK = 32  # values per scale along head_dim (llama.cpp QK8_0 = QK4_0 = 32; KIVI's group size)

# Speed notes (CPU, one thread): reads on the CPU go through each format's numba ``decode_row``
# (:mod:`niah.kv.kernels.rowkernels`); the torch paths of these formats serve other devices.  In them, fresh
# full-size tensors cost page faults, so each method allocates one float32 working tensor and updates it in place;
# float -> uint8 casts are much slower than float -> int8, so small codes go through int8 (:func:`_small_codes`).
# Measure with ``python -m niah bench kv``.


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
