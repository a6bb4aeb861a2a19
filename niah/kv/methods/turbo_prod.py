"""``TurboQuant_prod`` (Algorithm 2 of arXiv 2504.19874): ``turbo2_prod``, ``turbo3_prod``, ``turbo4_prod``.

``b-1`` bits of ``TurboQuant_mse``, then the 1-bit QJL sketch ``sign(S r)`` of the residual ``r = u - u_hat_mse``
with an i.i.d. ``N(0,1)`` matrix ``S``, plus ``||r||`` in fp16: ``analytical_bits = b + 32/d``.  ``dequantize``
returns ``||x|| (u_hat_mse + ||r|| sqrt(pi/2)/d S^T sign(S r))``, whose inner product with any query is the paper's
unbiased estimator.  The sketch is taken in the rotated basis, ``S (Pi r)``: ``S Pi`` is itself i.i.d. ``N(0,1)``
(Gaussian matrices are rotation invariant), so this is exactly the paper's construction, one matmul cheaper.

Stored: ``codes: uint8 (B, H, T, d * (b-1) / 8)`` and ``signs: uint8 (B, H, T, d / 8)`` (bit planes), ``norm`` and
``rnorm``: fp16 ``(B, H, T)``.  Rotations, codebooks and reads: :mod:`.turbo_base`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..base import Packed
from ..kernels import rowkernels
from ..kernels.turbo_encode import _TINY, _prod_encoder
from ..packing import pack_planes
from ..registry import register
from .turbo_base import (
    _CodeBlock,
    _codebook,
    _encode,
    _layer_matrices,
    _mse_stage,
    _norm16,
    _padded,
    _rotate,
    _Stage,
    _Turbo,
)


@functools.lru_cache(maxsize=1024)
def _prod_basis(seed: int, layer_idx: int, dim: int, heads: int, device: str) -> torch.Tensor:
    """``[Pi; S Pi]``: ``(heads, 2 dim, dim)``, the stacked bases of ``TurboQuant_prod``'s two stages (made once,
    not at every read: made per read, the product was a large share of a one-token chunk's scores)."""
    rot = _layer_matrices("rot", seed, layer_idx, dim, heads, device)
    return torch.cat([rot, _layer_matrices("qjl", seed, layer_idx, dim, heads, device) @ rot], dim=-2)


@dataclass
class TurboQuantProd(_Turbo):
    """``TurboQuant_prod`` at ``bits`` bits per coordinate: ``bits-1`` MSE bits plus a 1-bit QJL residual."""

    name: str = "turbo3_prod"
    bits: int = 3
    tokenwise = True

    def __post_init__(self):
        if self.bits < 2:
            raise ValueError(f"{self.name}: TurboQuant_prod needs bits >= 2 (bits-1 for the MSE stage, 1 for QJL)")

    def analytical_bits(self, head_dim: int) -> float:
        return self.bits + 32 / head_dim

    def quantize(self, x: torch.Tensor) -> Packed:
        self._check(x)
        b, h, t, d = x.shape
        mb = self.bits - 1
        rot, qjl = self._matrices("rot", d, h, x.device), self._matrices("qjl", d, h, x.device)
        if rowkernels.usable(x):
            return self._cpu_quantize(x, rot, qjl)
        y, norm = _rotate(x, rot)
        codes = _encode(y, norm, mb)
        u_hat = _CodeBlock.mse(codes, torch.ones_like(norm.squeeze(-1)), mb, rot).rotated()  # c(codes): Pi basis
        r = y.div_(norm.clamp_min(_TINY)).sub_(u_hat)  # u - u_hat in the rotated basis (the norm of u - u_hat_mse)
        rnorm = torch.linalg.vector_norm(r, dim=-1)
        sketch = torch.matmul(r, qjl.transpose(-1, -2))  # rows of (S r)^T
        return self._packed(x, codes, norm, pack_planes((sketch >= 0).to(torch.uint8), 1), rnorm)

    def _cpu_quantize(self, x: torch.Tensor, rot: torch.Tensor, qjl: torch.Tensor) -> Packed:
        """:meth:`quantize` in one numba pass (:func:`_prod_encoder`)."""
        b, h, t, d = x.shape
        mb = self.bits - 1
        norm, rnorm = torch.empty(b, h, t, 1), torch.empty(b, h, t)
        codes, signs = (
            torch.empty(b, h, t, d * mb // 8, dtype=torch.uint8),
            torch.empty(b, h, t, d // 8, dtype=torch.uint8),
        )
        book = _codebook(d, mb, x.device)
        matrices = [m.transpose(-1, -2).contiguous().numpy() for m in (rot, qjl)]
        outputs = [rowkernels.rows(o) for o in (norm, codes, rnorm.unsqueeze(-1), signs)]
        outputs[2] = outputs[2].reshape(-1)
        _prod_encoder(mb, d)(rowkernels.rows(x.float()), *matrices, t, book.mids15, book.table.numpy(), *outputs)
        return self._packed(x, codes, norm, signs, rnorm)

    def _packed(self, x: torch.Tensor, codes, norm, signs, rnorm) -> Packed:
        tensors = {"codes": codes, "norm": _norm16(norm), "signs": signs, "rnorm": rnorm.to(torch.float16)}
        return Packed(tensors, tuple(x.shape), x.dtype, {"method": self.name})

    def _block(self, p: Packed) -> _CodeBlock:
        """The MSE stage, ``||x|| c`` in the ``Pi`` basis, and the QJL stage, ``||x|| ||r|| sqrt(pi/2)/d
        sign(S r)`` in the ``S Pi`` basis: ``x_hat = [Pi; S Pi]^T [stage 1; stage 2]``."""
        b, h, t, d = p.shape
        codes, norm = p.tensors["codes"], p.tensors["norm"]
        qjl_scale = norm.float() * p.tensors["rnorm"].float() * (math.sqrt(math.pi / 2) / d)
        stages = (
            _mse_stage(codes, norm, self.bits - 1, d),
            _Stage(p.tensors["signs"], qjl_scale, _SIGNS.to(codes.device), 1),
        )
        return _CodeBlock(stages, _prod_basis(self.seed, self.layer_idx, d, h, str(codes.device)))


_SIGNS = torch.from_numpy(_padded(np.array([-1.0, 1.0]), 16))  # the values of QJL sign bits 0 and 1, as a stage's table


for _b in (2, 3, 4):
    register(f"turbo{_b}_prod")(lambda b=_b: TurboQuantProd(f"turbo{b}_prod", bits=b))
