"""What the TurboQuant KV-cache quantizers share (Zandieh et al., "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", arXiv 2504.19874).

A stored vector ``x`` (one token of one KV head) is kept as its fp16 norm and the codes of its direction
``u = x / ||x||`` under a Haar-random rotation ``Pi``: each coordinate of ``Pi u`` becomes the index of its nearest
Lloyd-Max centroid for the density of Lemma 1 (:mod:`niah.kv.codebooks`), packed at ``b`` bits in the bit planes of
:func:`niah.kv.packing.pack_planes`.  ``Pi`` (and ``S`` for ``_prod``) is one per (decoder layer, KV head), made from
a seed derived from ``(seed, layer_idx, head, kind)``; it is never stored, and :meth:`for_layer` returns a copy
seeded for that layer.  This module holds the rotations and their seeds, the codebooks, the MSE encoding, the
:class:`_Turbo` base and the stored form every read goes through (:class:`_CodeBlock`); the variants are
:mod:`.turbo_mse`, :mod:`.turbo_prod` and :mod:`.turbo_split`.  ``head_dim`` must be a multiple of 8 and at least
16 (of 16 for ``turbo2.5`` and ``turbo3.5``).  See docs/design-notes.md#niah.kv.methods.turbo_base.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..base import KVQuantizer, Packed, check_kv_shape
from ..codebooks import lloyd_max_codebook
from ..kernels import rowkernels
from ..kernels.turbo_decode import _block_row
from ..kernels.turbo_encode import _TINY, _rotate_encoder
from ..packing import pack_planes, plane_run, unpack_planes

_KIND = {"rot": 0, "qjl": 1, "rot_hi": 2, "rot_lo": 3}
_FP16_MAX = float(torch.finfo(torch.float16).max)


def derived_seed(seed: int, layer_idx: int, head: int, kind: str) -> int:
    """A 63-bit generator seed for one (base seed, layer, head, matrix kind)."""
    state = np.random.SeedSequence([int(seed), int(layer_idx), int(head), _KIND[kind]]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def haar_rotation(dim: int, seed: int) -> torch.Tensor:
    """A Haar-random ``dim x dim`` orthogonal matrix (float64): QR of a Gaussian matrix, sign-fixed by diag(R)."""
    return torch.from_numpy(_orthonormalize_columns(gaussian_matrix(dim, seed).numpy()))


def _orthonormalize_columns(a: np.ndarray) -> np.ndarray:
    """The Q of ``a = QR`` with ``diag(R) > 0`` (classical Gram-Schmidt, applied twice per column).

    This is exactly LAPACK's Q times ``sign(diag(R))`` (agreement ~1e-15), but uses only elementwise numpy:
    a threaded BLAS/LAPACK QR of a 128 x 128 matrix can be very slow on a busy machine with few cores.
    """
    d = a.shape[1]
    q = np.empty_like(a)
    for j in range(d):
        v = a[:, j].copy()
        if j:
            qj = q[:, :j]
            for _ in range(2):
                v -= (qj * (qj * v[:, None]).sum(0)).sum(1)
        q[:, j] = v / np.sqrt((v * v).sum())
    return q


def gaussian_matrix(dim: int, seed: int) -> torch.Tensor:
    """An i.i.d. ``N(0, 1)`` ``dim x dim`` matrix (float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(dim, dim, generator=g, dtype=torch.float64)


class _Codebook:
    """One ``(dim, bits)`` codebook on one device, with the lookup tables that make coding fast.

    Encoding (nearest centroid): for ``bits <= 2``, a sum of comparisons against the ``2^bits - 1`` midpoints;
    for more bits, a uniform grid over ``[-1, 1]`` fine enough that each cell holds at most one midpoint:
    ``code = lut_code[cell] + (y > lut_mid[cell])``.  Both give exactly ``torch.bucketize(y, midpoints)``
    (the nearest centroid; exact ties go to the lower one), several times faster than ``bucketize`` on CPU.
    """

    def __init__(self, dim: int, bits: int, device: torch.device):
        c = lloyd_max_codebook(dim, bits)
        mids = (c[1:] + c[:-1]) / 2
        self.bits = bits
        self.centroids = torch.tensor(c, dtype=torch.float32, device=device)
        self.table = torch.from_numpy(_padded(c, 16)).to(device)  # the centroids padded to 16: a stage's table
        self.mids = torch.tensor(mids, dtype=torch.float32, device=device)
        self.mid_list = [float(m) for m in self.mids]  # the float32 values, as python scalars
        self.mids15 = _padded(self.mids.cpu().numpy(), 15)  # for the CPU encoder (_row_encoder)
        if bits > 2:
            m32 = self.mids.double().cpu().numpy()
            cells = max(256, int(math.ceil(2.0 / (float(np.min(np.diff(m32))) / 2))))
            # keep every midpoint >= 1e-3 cell widths from a cell edge: then a float32 rounding of the cell
            # index (< 1e-3 widths) can move ``y`` only across an edge with no midpoint nearby, which does not
            # change the code
            while True:
                frac = np.mod((m32 + 1.0) * cells / 2.0, 1.0)
                if np.min(np.minimum(frac, 1.0 - frac)) > 1e-3:
                    break
                cells += 1
            width = 2.0 / cells
            edges = -1.0 + width * np.arange(cells)
            lo = np.searchsorted(m32, edges, side="left")  # midpoints strictly left of the cell
            ext = np.append(m32, np.inf)
            inside = np.where(ext[lo] < edges + width, ext[lo], np.inf)  # the midpoint in the cell, if any
            self.cells, self.scale = cells, 1.0 / width
            self.lut_code = torch.tensor(lo, dtype=torch.uint8, device=device)
            self.lut_mid = torch.tensor(inside, dtype=torch.float32, device=device)

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """Nearest-centroid indices (uint8, same shape as ``y``)."""
        if self.bits <= 2:
            codes = torch.gt(y, self.mid_list[0]).to(torch.uint8)
            for m in self.mid_list[1:]:
                codes += torch.gt(y, m)
            return codes
        flat = y.reshape(-1)
        cell = torch.mul(flat, self.scale).add_(self.scale).clamp_(0, self.cells - 1).to(torch.int32)
        codes = torch.index_select(self.lut_code, 0, cell)
        codes += torch.index_select(self.lut_mid, 0, cell) < flat
        return codes.view(y.shape)


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    """float32 ``values`` followed by zeros up to ``size``: the numba coders read a fixed number of entries
    (the 15 midpoints or 16 centroids of 4 bits) whatever the bit width."""
    out = np.zeros(size, np.float32)
    out[: len(values)] = values
    return out


@functools.lru_cache(maxsize=1024)
def _layer_matrices(kind: str, seed: int, layer_idx: int, dim: int, heads: int, device: str) -> torch.Tensor:
    """Shared by every quantizer instance (each new cache makes new per-layer copies, which reuse these)."""
    make = gaussian_matrix if kind == "qjl" else haar_rotation
    m = torch.stack([make(dim, derived_seed(seed, layer_idx, h, kind)) for h in range(heads)])
    return m.to(device=device, dtype=torch.float32).contiguous()


_CODEBOOKS: dict = {}


def _codebook(dim: int, bits: int, device: torch.device) -> _Codebook:
    key = (dim, bits, str(device))
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = _Codebook(dim, bits, device)
    return _CODEBOOKS[key]


def _norm16(norm: torch.Tensor) -> torch.Tensor:
    """fp16 copy of ``(..., 1)`` norms, shape ``(...)``; clamped to the fp16 range."""
    return norm.squeeze(-1).clamp_max(_FP16_MAX).to(torch.float16)


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, ||y||)`` with ``y = Pi x``: float32 ``(B,H,T,k)`` and ``(B,H,T,1)``, for ``rot = Pi: (H, k, d)`` or
    ``(B, H, k, d)`` with orthonormal rows (a rotation, ``||y|| = ||x||``; or one of the split variants' halves,
    ``||y|| = ||x_half||``)."""
    y = torch.matmul(x.float(), rot.transpose(-1, -2))
    return y, torch.linalg.vector_norm(y, dim=-1, keepdim=True)


def _mse_encode(x: torch.Tensor, basis: torch.Tensor, bits: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(packed codes, norm)]`` of ``TurboQuant_mse`` for each stage of ``bits`` (one; or the split variants'
    two halves), stage ``s`` coding the ``k`` coordinates ``s k .. (s + 1) k - 1`` of ``y = Pi x``, ``Pi = basis:
    (H, K, d)`` or ``(B, H, K, d)``, ``K = k len(bits)``: the nearest centroids of ``y_s / ||y_s||``, packed by
    :func:`pack_planes`, and ``||y_s||`` ``(B,H,T,1)``.  On the CPU, one numba pass over ``x`` for all stages
    (:func:`_rotate_encoder`)."""
    k = basis.shape[-2] // len(bits)
    if not rowkernels.usable(x):
        rotated = [(*_rotate(x, basis[..., s * k : (s + 1) * k, :]), b) for s, b in enumerate(bits)]
        return [(_encode(y, norm, b), norm) for y, norm, b in rotated]
    b, h, t, d = x.shape
    out = [(torch.empty(b, h, t, 1), torch.empty(b, h, t, k * n // 8, dtype=torch.uint8)) for n in bits]
    args = [
        (_codebook(k, n, x.device).mids15, norm.view(-1, 1).numpy(), codes.view(-1, codes.shape[-1]).numpy())
        for n, (norm, codes) in zip(bits, out)
    ]
    rot_t = basis.transpose(-1, -2).reshape(-1, d, basis.shape[-2]).contiguous().numpy()
    _rotate_encoder(bits, plane_run(k))(rowkernels.rows(x.float()), t, rot_t, *args[0], *args[-1])
    return [(codes, norm) for norm, codes in out]


def _encode(y: torch.Tensor, norm: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed nearest-centroid codes of ``y / norm`` (``y``: rotated rows, left unchanged), with torch (the
    CPU codes inside the fused passes of :mod:`niah.kv.kernels.turbo_encode` instead)."""
    return pack_planes(_codebook(y.shape[-1], bits, y.device).encode(y / norm.clamp_min(_TINY)), bits)


@dataclass
class _Turbo(KVQuantizer):
    """Shared machinery: seeds, per-head matrices, checks."""

    name: str = "turbo"
    seed: int = 0
    layer_idx: int = 0

    def for_layer(self, layer_idx: int) -> "_Turbo":
        return dataclasses.replace(self, layer_idx=layer_idx)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < 16 or head_dim % 8:
            raise ValueError(
                f"{self.name}: head_dim must be a multiple of 8 and at least 16 (codes pack into whole bytes; "
                f"below 16 the fp16 norm alone costs >= 1 bit per value); got head_dim={head_dim}"
            )

    def _check(self, x: torch.Tensor) -> None:
        check_kv_shape(x)
        self.check_head_dim(x.shape[-1])

    def _matrices(self, kind: str, dim: int, heads: int, device: torch.device) -> torch.Tensor:
        """``(heads, dim, dim)`` float32: this layer's per-head rotations (or QJL matrices), from the seed."""
        return _layer_matrices(kind, self.seed, self.layer_idx, dim, heads, str(device))

    def _block(self, p: Packed) -> "_CodeBlock":
        """What ``p`` stores, as one :class:`_CodeBlock`."""
        raise NotImplementedError

    def dequantize(self, p: Packed) -> torch.Tensor:
        return self._block(p).dequantize().to(p.dtype)

    def scores(self, p: Packed, q: torch.Tensor) -> torch.Tensor:
        return self._block(p).scores(q)

    def weighted_sum(self, p: Packed, w: torch.Tensor) -> torch.Tensor:
        return self._block(p).weighted_sum(w)


class _Stage(NamedTuple):
    """``scale * c(codes)`` for each stored vector, in some basis."""

    codes: torch.Tensor  # uint8 (B, H, T, k * bits / 8), packed by pack_planes
    scale: torch.Tensor  # (B, H, T): fp16 norms, or float32
    table: torch.Tensor  # float32 (16,): the value of each code, zero-padded to 16 (the row decoders read 16)
    bits: int

    @property
    def size(self) -> int:
        """``k``, codes per stored vector."""
        return self.codes.shape[-1] * 8 // self.bits


class _CodeBlock(NamedTuple):
    """Stored vectors of the form ``Pi^T s``, ``s`` the values of one or two :class:`_Stage` s one after the
    other, and the reads of them.  ``TurboQuant_mse``: one stage (``scale = ||x||``, Lloyd-Max centroids) and
    ``Pi`` its rotation; ``TurboQuant_prod`` adds its QJL sketch (``c = +-1``) as a second stage, with ``S Pi``
    stacked under ``Pi``; the split variants have a stage per channel half.  Reads work in the ``Pi`` basis,
    ``q . k = (Pi q) . s``: the query is turned once per step and a weighted sum turned back once, instead of one
    matmul per stored token.  On the CPU the codes are read by the row kernels (:mod:`niah.kv.kernels.rowkernels`), all
    stages in one pass; elsewhere through :meth:`rotated`, with torch."""

    stages: tuple[_Stage, ...]
    rot: torch.Tensor  # Pi: (H, K, d) or (B, H, K, d), K the stages' codes per vector together

    @classmethod
    def mse(cls, codes: torch.Tensor, norm: torch.Tensor, bits: int, rot: torch.Tensor) -> "_CodeBlock":
        """One ``TurboQuant_mse`` stage of ``rot.shape[-2]`` codes per vector."""
        return cls((_mse_stage(codes, norm, bits, rot.shape[-2]),), rot)

    def _row_args(self) -> tuple:
        return tuple(
            (rowkernels.rows(st.codes), rowkernels.rows(st.scale), st.table.numpy(), plane_run(st.size))
            for st in self.stages
        )

    def _decoder(self):
        return _block_row(tuple((st.bits, st.size) for st in self.stages))

    def rotated(self) -> torch.Tensor:
        """The stored vectors in the ``Pi`` basis: float32 ``(B, H, T, K)``.  With torch, each stage's codes
        come from :func:`unpack_planes`, then a table lookup."""
        if rowkernels.usable(self.stages[0].codes):
            return rowkernels.dequantize(
                self._decoder(), self._row_args(), (*self.stages[0].codes.shape[:-1], self.rot.shape[-2])
            )
        parts = [
            st.table[unpack_planes(st.codes, st.bits, st.size).to(torch.int32)] * st.scale.float()[..., None]
            for st in self.stages
        ]
        return torch.cat(parts, dim=-1)

    def dequantize(self) -> torch.Tensor:
        """``(B, H, T, d)``: ``Pi^T`` of :meth:`rotated`."""
        return torch.matmul(self.rotated(), self.rot)

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """``q: (B, H, G, d)`` -> ``(B, H, G, T)``."""
        q_rot = q @ self.rot.transpose(-1, -2)
        if rowkernels.usable(self.stages[0].codes):
            return rowkernels.scores(self._decoder(), self._row_args(), q_rot, self.stages[0].codes.shape[-2])
        return q_rot @ self.rotated().transpose(-1, -2)

    def weighted_sum(self, w: torch.Tensor) -> torch.Tensor:
        """``w: (B, H, G, T)`` -> ``(B, H, G, d)``."""
        if rowkernels.usable(self.stages[0].codes):
            summed = rowkernels.weighted_sum(self._decoder(), self._row_args(), w, self.rot.shape[-2])
        else:
            summed = w @ self.rotated()
        return summed @ self.rot


def _mse_stage(codes: torch.Tensor, norm: torch.Tensor, bits: int, size: int) -> _Stage:
    return _Stage(codes, norm, _codebook(size, bits, codes.device).table, bits)
