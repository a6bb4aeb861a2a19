"""TurboQuant KV-cache quantizers (Zandieh et al., "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", arXiv 2504.19874).

Every stored vector ``x`` (one token of one KV head) is split into its norm ``||x||`` (kept as fp16) and its
direction ``u = x / ||x||``.  The direction is multiplied by a Haar-random rotation ``Pi``; each coordinate
of ``Pi u`` then follows the known density of Lemma 1 (see :mod:`niah.kv.codebooks`), and is replaced by the
index of its nearest Lloyd-Max centroid for that density, packed densely at ``b`` bits (in the bit planes of
:func:`niah.kv.packing.pack_planes`, which the CPU row kernels decode in SIMD lanes).

Registered methods
------------------
``turbo2, turbo3, turbo4``
    ``TurboQuant_mse`` (Algorithm 1): ``b`` bits per coordinate.  Stored per token and head: ``d`` codes of
    ``b`` bits and one fp16 norm, so ``analytical_bits = b + 16/d``.
``turbo2_prod, turbo3_prod, turbo4_prod``
    ``TurboQuant_prod`` (Algorithm 2): ``b-1`` bits of ``TurboQuant_mse``, then the 1-bit QJL sketch
    ``sign(S r)`` of the residual ``r = u - u_hat_mse`` with an i.i.d. ``N(0,1)`` matrix ``S``, plus
    ``||r||`` in fp16: ``analytical_bits = b + 32/d``.  ``dequantize`` returns
    ``||x|| (u_hat_mse + ||r|| sqrt(pi/2)/d S^T sign(S r))``, whose inner product with any query is the
    paper's unbiased estimator.  The sketch is taken of the residual in the rotated basis, ``S (Pi r)``; that
    is the same as applying the Gaussian matrix ``S Pi`` to ``r``, and ``S Pi`` is itself i.i.d. ``N(0,1)``
    (Gaussian matrices are rotation invariant), so it is exactly the paper's construction and saves a matmul.
``turbo2.5, turbo3.5``
    Mixed precision over channels (paper, Section 4.3: "splitting channels into outlier and non-outlier
    sets, and applying two independent instances of TurboQuant to each, allocating higher bit precision to
    outliers").  The paper states its 2.5-bit example as "32 outlier channels are quantized at 3 bits, while
    the remaining 96 channels use 2 bits, leading to an effective bit precision of (32x3 + 96x2)/128 = 2.5";
    that arithmetic actually gives 2.25, and the paper gives no split for 3.5.  We use the split that makes
    the names exact and keeps the paper's bit widths: half the channels (``d/2``) at ``b+1`` bits and half at
    ``b`` bits, i.e. ``turbo2.5`` = ``d/2`` ch at 3 bits + ``d/2`` at 2 bits, ``turbo3.5`` = ``d/2`` at 4 +
    ``d/2`` at 3.  Outlier rule (the paper does not say how its outlier channels are picked): per (batch, KV
    head), the ``d/2`` channels (in the original, un-rotated basis) with the largest RMS over the tokens of
    the layer's first stored block (the prefill, in the needle protocol; ties to the lower channel index),
    kept for every later block of the layer (:meth:`quantize_after`).  Each group gets its own rotation (of
    dimension ``d/2``), its own codebook and its own fp16 norm, so ``analytical_bits = b + 0.5 + 32/d``.
    The channel choice is stored as a 1-bit mask, ``d`` bits per (batch, head), shared by the layer's blocks
    and counted in the ``nbytes`` of each (about ``1/tokens`` bits per value on a block of ``tokens``), but not
    in ``analytical_bits``.  Choosing once per layer lets one-token decode blocks merge like the other formats';
    it makes the channels depend on which tokens the first block held.

Rotations and seeds
-------------------
``Pi`` is the Q factor of the QR decomposition of a ``d x d`` standard Gaussian matrix, sign-fixed by
``diag(R)`` so that it is exactly Haar distributed.  There is one per (decoder layer, KV head) (per group for
the split variants), and ``S`` likewise; each is generated from a seed derived from
``(seed, layer_idx, head, kind)`` with ``numpy.random.SeedSequence``, so keys and values of a layer share them
and they are fully reproducible.  They are *not* stored with the cache and not counted as per-token storage:
any reader regenerates them from the seed (cost: ``O(d^3)`` once per layer and head, amortized over all
tokens; kept in a process-wide cache shared by all quantizer instances, so each new cache reuses them).
:meth:`for_layer` returns a copy seeded for that layer.

Speed: quantize and dequantize are one ``(tokens x d) @ (d x d)`` matmul per head (two for ``_prod``) plus one
pass over the codes; the dense rotation alone costs about half a copy.  On the CPU, quantize is one numba pass
over ``x`` in tiles that stay in cache (:func:`_rotate_encoder`, :func:`_prod_encoder`), and every read decodes
all of a variant's codes in one pass (:class:`_CodeBlock`, :mod:`niah.kv.rowkernels`).  Reads in a decode step
need no rotation per token.

Constraints: ``head_dim`` must be a multiple of 8 and at least 16 (a multiple of 16 for ``turbo2.5`` and
``turbo3.5``).  Multiples of 8 let every code width pack into whole bytes with no padding; below 16 the fp16
norm alone costs a bit or more per value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from . import rowkernels
from .base import KVQuantizer, Packed, check_kv_shape
from .codebooks import lloyd_max_codebook
from .packing import pack_bits, pack_planes, plane_run, unpack_bits, unpack_planes
from .registry import register

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


@functools.lru_cache(maxsize=1024)
def _prod_basis(seed: int, layer_idx: int, dim: int, heads: int, device: str) -> torch.Tensor:
    """``[Pi; S Pi]``: ``(heads, 2 dim, dim)``, the stacked bases of ``TurboQuant_prod``'s two stages (made once,
    not at every read: made per read, the product was a large share of a one-token chunk's scores)."""
    rot = _layer_matrices("rot", seed, layer_idx, dim, heads, device)
    return torch.cat([rot, _layer_matrices("qjl", seed, layer_idx, dim, heads, device) @ rot], dim=-2)


_CODEBOOKS: dict = {}


def _codebook(dim: int, bits: int, device: torch.device) -> _Codebook:
    key = (dim, bits, str(device))
    if key not in _CODEBOOKS:
        _CODEBOOKS[key] = _Codebook(dim, bits, device)
    return _CODEBOOKS[key]


def _norm16(norm: torch.Tensor) -> torch.Tensor:
    """fp16 copy of ``(..., 1)`` norms, shape ``(...)``; clamped to the fp16 range."""
    return norm.squeeze(-1).clamp_max(_FP16_MAX).to(torch.float16)


_TINY = torch.finfo(torch.float32).tiny  # the divisor for a zero vector, which then gets ``y = 0``


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
    CPU runs :func:`_row_encoder` inside :func:`_rotate_encoder` and :func:`_prod_encoder` instead)."""
    return pack_planes(_codebook(y.shape[-1], bits, y.device).encode(y / norm.clamp_min(_TINY)), bits)


@functools.lru_cache(maxsize=None)
def _row_encoder(bits: int, run: int):
    """The CPU encoder of ``bits``-bit codes (1 to 4) in runs of ``run``, compile-time constants as in
    :func:`_planes_reader`: ``encode(y, col, k, norm, mids, out)``, ``y: (R, K)`` rotated rows of which the ``k``
    columns from ``col`` are coded, ``norm: (R, 1)``, ``mids`` the codebook's midpoints padded to 15 -> ``out:
    uint8 (R, k * bits / 8)`` in the bit planes of :func:`pack_planes`.  The code of ``u = y / norm`` is the
    number of midpoints below it (``torch.bucketize``: the nearest centroid, ties to the lower one), found bit
    by bit, top bit first: each bit is ``u > m`` for the midpoint that splits the codes left by the bits above
    it.  That is ``bits`` comparisons and a tree of selects per value, which LLVM vectorizes (faster than
    counting all ``2^bits - 1`` midpoints for 2 and 3 bits, and even for 4).  No fastmath: the division and
    comparisons are torch's, bit for bit."""

    @njit(boundscheck=False, nogil=True)
    def encode(y, col, k, norm, mids, out):
        m0, m1, m2, m3, m4, m5, m6, m7 = mids[0], mids[1], mids[2], mids[3], mids[4], mids[5], mids[6], mids[7]
        m8, m9, m10, m11, m12, m13, m14 = mids[8], mids[9], mids[10], mids[11], mids[12], mids[13], mids[14]
        for r in range(out.shape[0]):
            n = max(norm[r, 0], np.float32(_TINY))
            # the row sliced once and the block count passed in: with the offset in every index, or the count
            # worked out from an array's shape here, this loop ran much slower
            row = y[r, col:]
            for block in range(k // run):
                w0, w1, w2, w3 = np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0)
                for j in range(run):
                    u = row[block * run + j] / n
                    # bottom-up trees of selects, each level in its own temporaries: written as one nested
                    # expression, LLVM turned the 4-bit tree into branches, far slower than the selects
                    b1 = b2 = b3 = False
                    if bits == 1:
                        b0 = u > m0
                    elif bits == 2:
                        b1 = u > m1
                        b0 = u > (m2 if b1 else m0)
                    elif bits == 3:
                        b2 = u > m3
                        b1 = u > (m5 if b2 else m1)
                        t0, t1 = (m2 if b1 else m0), (m6 if b1 else m4)
                        b0 = u > (t1 if b2 else t0)
                    else:
                        b3 = u > m7
                        b2 = u > (m11 if b3 else m3)
                        s0, s1 = (m5 if b2 else m1), (m13 if b2 else m9)
                        b1 = u > (s1 if b3 else s0)
                        t0, t1, t2, t3 = (m2 if b1 else m0), (m6 if b1 else m4), (m10 if b1 else m8), (m14 if b1 else m12)
                        t01, t23 = (t1 if b2 else t0), (t3 if b2 else t2)
                        b0 = u > (t23 if b3 else t01)
                    w0, w1, w2, w3 = rowkernels.set_lane_bits(w0, w1, w2, w3, b0, b1, b2, b3, j)
                rowkernels.store_planes(out, r, block, bits, run, w0, w1, w2, w3)

    return encode


_TILE = 1024  # rows per tile of _rotate_encoder: a 64-dim tile of x and its rotation take 0.5 MB (L2 holds 1.25 here)


@functools.lru_cache(maxsize=None)
def _rotate_encoder(bits: tuple[int, ...], run: int):
    """The CPU path of :func:`_mse_encode` for one stage (``bits = (b,)``) or two (the split variants' halves,
    ``(b_hi, b_lo)``), each of ``k`` codes in runs of ``run``: ``encode(x, tokens, rot_t, mids, norm, out, mids2,
    norm2, out2)``, ``x: (R, d)`` float32 rows, ``tokens`` per (batch, head), ``rot_t: (N, d, K)`` the transposed
    matrices ``Pi`` per head (``N = H``) or per (batch, head) (``N = B H``), ``K = k len(bits)`` -> ``norm: (R, 1)``
    and ``out`` as in :func:`_row_encoder`; the second stage's arguments likewise (a single stage passes its own
    again, unused).  Per tile of :data:`_TILE` rows of one (batch, head), BLAS rotates the tile (``np.dot``,
    scipy's sgemm) once for all stages, and each stage's norms and codes are computed from its columns while the
    tile is in cache, instead of three passes over full-size tensors.  The norms are float32 sums in numba's
    order (:func:`_sum_squares`): they can differ from torch's ``vector_norm`` in the last bit, which can move a
    code only where ``y / norm`` ties a midpoint.  The fused pass beats torch's matmul and norm followed by
    :func:`_row_encoder` at 3 bits, and the split variants' two stages (3 and 2 bits) cost no more than one 3-bit
    stage over the same product (measure with ``python -m niah bench kv``)."""
    encode, encode2 = _row_encoder(bits[0], run), _row_encoder(bits[-1], run)
    two = len(bits) == 2

    @njit(nogil=True)
    def rotate_encode(x, tokens, rot_t, mids, norm, out, mids2, norm2, out2):
        y = np.empty((_TILE, rot_t.shape[2]), np.float32)
        k = rot_t.shape[2] // 2 if two else rot_t.shape[2]
        for first in range(0, x.shape[0], tokens):  # the rows of one (batch, head): rows are (B, H, T) flattened
            head = first // tokens % rot_t.shape[0]
            for start in range(first, first + tokens, _TILE):
                n = min(_TILE, first + tokens - start)
                np.dot(x[start : start + n], rot_t[head], y[:n])
                for i in range(n):
                    norm[start + i, 0] = np.sqrt(_sum_squares(y, i, 0, k))
                    if two:
                        norm2[start + i, 0] = np.sqrt(_sum_squares(y, i, k, 2 * k))
                encode(y[:n], 0, k, norm[start : start + n], mids, out[start : start + n])
                if two:
                    encode2(y[:n], k, k, norm2[start : start + n], mids2, out2[start : start + n])

    return rotate_encode


@functools.lru_cache(maxsize=None)
def _prod_encoder(bits: int, dim: int):
    """The CPU path of :meth:`TurboQuantProd.quantize` with ``bits`` MSE bits: ``encode(x, rot_t, qjl_t, tokens,
    mids, table, norm, codes, rnorm, signs)``, ``x: (R, d)`` float32 rows of ``tokens`` per (batch, head),
    ``rot_t``, ``qjl_t: (H, d, d)`` the transposed ``Pi`` and ``S``, the codebook's padded midpoints and
    centroids -> ``norm: (R, 1)``, ``codes``, ``rnorm: (R,)`` and ``signs`` (1-bit planes).  Per tile of
    :data:`_TILE` rows, as :func:`_rotate_encoder`, then the residual ``u - c(codes)`` of each row, its norm, and
    the signs of its sketch (a second ``np.dot``), while the tile is in cache; the torch path makes a dozen passes
    over full-size tensors instead."""
    run = plane_run(dim)
    encode, read, pack_signs = _row_encoder(bits, run), _stage_reader(bits, dim), rowkernels.plane_packer(1, run)

    @njit(nogil=True)
    def prod_encode(x, rot_t, qjl_t, tokens, mids, table, norm, codes, rnorm, signs):
        y, res, sketch = np.empty((_TILE, dim), np.float32), np.empty((_TILE, dim), np.float32), np.empty((_TILE, dim), np.float32)
        u_hat, positive = np.empty(dim, np.float32), np.empty((_TILE, dim), np.uint8)
        for first in range(0, x.shape[0], tokens):  # the rows of one (batch, head)
            head = first // tokens % rot_t.shape[0]
            for start in range(first, first + tokens, _TILE):
                n = min(_TILE, first + tokens - start)
                np.dot(x[start : start + n], rot_t[head], y[:n])
                for i in range(n):
                    norm[start + i, 0] = np.sqrt(_sum_squares(y, i, 0, dim))
                encode(y[:n], 0, dim, norm[start : start + n], mids, codes[start : start + n])
                for i in range(n):
                    read(codes, np.float32(1.0), table, run, start + i, u_hat, 0)  # c(codes), unit scale
                    unit = max(norm[start + i, 0], np.float32(_TINY))
                    for j in range(dim):
                        res[i, j] = y[i, j] / unit - u_hat[j]
                    rnorm[start + i] = np.sqrt(_sum_squares(res, i, 0, dim))
                np.dot(res[:n], qjl_t[head], sketch[:n])
                for i in range(n):
                    for j in range(dim):
                        positive[i, j] = sketch[i, j] >= 0
                pack_signs(positive[:n], signs[start : start + n])

    return prod_encode


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


@njit(fastmath={"reassoc", "nsz"}, boundscheck=False, nogil=True)
def _sum_squares(x, r, lo, hi):
    """``sum of x[r, j]^2`` over ``lo <= j < hi`` in float32, vectorized (reassociated), over a slice of the row:
    a loop ``range(lo, hi)`` over the row itself made the split variants' encode slower.  Called, not inlined by
    numba: LLVM inlines it and keeps its fast-math flags, while numba's own inlining would compile it under the
    caller's (none)."""
    row = x[r, lo:hi]
    acc = np.float32(0.0)
    for j in range(row.shape[0]):
        acc += row[j] * row[j]
    return acc


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


@functools.lru_cache(maxsize=None)
def _planes_reader(bits: int, run: int):
    """``read(codes, scale, c, run_at_run_time, r, out, offset)``: writes ``scale * c(codes of row r)`` into
    ``out[offset:]``, for ``bits``-bit codes in the bit planes of :func:`pack_planes`, runs of ``run`` codes, the
    centroids ``c`` padded to 16 entries.  Each lane of a run shifts its bit out of every plane and picks its
    centroid with a tree of selects on those bits; LLVM vectorizes both.  ``bits`` and ``run`` are compile-time
    constants, except for one bit: LLVM unrolls a constant 32-lane loop of one select into scalar code, so that
    loop reads its count at run time (:func:`_one_bit_pairs` is faster where it applies).  This is faster than
    unpacking 8 codes per word and loading each centroid; a run-time trip count is slower for 2-4 bits and faster
    for one bit."""

    @njit(**rowkernels.DECODER)
    def read(codes, s, c, run_at_run_time, r, out, offset):
        lanes = run_at_run_time if bits == 1 else run
        # loaded once: ``out`` might alias these for all numba knows
        c0, c1, c2, c3, c4, c5, c6, c7 = c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        c8, c9, c10, c11, c12, c13, c14, c15 = c[8], c[9], c[10], c[11], c[12], c[13], c[14], c[15]
        for block in range(codes.shape[1] * 8 // (bits * run)):
            w0, w1, w2, w3 = rowkernels.plane_words(codes, r, block, bits, run)
            for j in range(lanes):
                b0, b1, b2, b3 = rowkernels.lane_bits(w0, w1, w2, w3, j)
                # bottom-up, one level of selects at a time (see _row_encoder)
                p0, p1, p2, p3 = (c1 if b0 else c0), (c3 if b0 else c2), (c5 if b0 else c4), (c7 if b0 else c6)
                p4, p5, p6, p7 = (c9 if b0 else c8), (c11 if b0 else c10), (c13 if b0 else c12), (c15 if b0 else c14)
                q0, q1, q2, q3 = (p1 if b1 else p0), (p3 if b1 else p2), (p5 if b1 else p4), (p7 if b1 else p6)
                v = p0 if bits == 1 else q0 if bits == 2 else (q1 if b2 else q0)
                if bits > 3:
                    v = (q3 if b2 else q2) if b3 else v
                out[offset + block * run + j] = v * s

    return read


@njit(**rowkernels.DECODER)
def _one_bit_pairs(codes, s, c, run_at_run_time, r, out, offset):
    """:func:`_planes_reader` for 1-bit codes in rows of a multiple of 64: one loop of 64 lanes per two runs,
    each lane picking its run's word, which LLVM vectorizes (a 32-lane loop of one select it unrolls into
    scalars, which made QJL scores slower)."""
    c0, c1 = c[0], c[1]
    for pair in range(codes.shape[1] // 8):
        w0 = rowkernels.plane_words(codes, r, 2 * pair, 1, 32)[0]
        w1 = rowkernels.plane_words(codes, r, 2 * pair + 1, 1, 32)[0]
        for j in range(64):
            bit = (w1 if j & 32 else w0) >> np.uint32(j & 31) & np.uint32(1)
            out[offset + 64 * pair + j] = (c1 if bit else c0) * s


def _stage_reader(bits: int, codes: int):
    """The reader of a stage of ``codes`` codes per vector at ``bits`` bits."""
    return _one_bit_pairs if bits == 1 and codes % 64 == 0 else _planes_reader(bits, plane_run(codes))


@functools.lru_cache(maxsize=None)
def _block_row(stages: tuple[tuple[int, int], ...]):
    """The row decoder (:mod:`niah.kv.rowkernels`) of a :class:`_CodeBlock` with one or two stages of ``(bits,
    codes per vector)``: ``stored`` holds one ``(codes, scale, table, run)`` per stage, and the stages' values
    follow one another in the row (one pass over the rows, not one per stage: a pass per stage re-reads the rows,
    which made ``TurboQuant_prod``'s reads slower)."""
    first_codes, read_first = stages[0][1], _stage_reader(*stages[0])
    if len(stages) == 1:

        @njit(**rowkernels.DECODER)
        def decode_row(stored, r, out):
            codes, scale, c, run = stored[0]
            read_first(codes, scale[r], c, run, r, out, 0)

        return decode_row
    read_second = _stage_reader(*stages[1])

    @njit(**rowkernels.DECODER)
    def decode_two(stored, r, out):
        (codes, scale, c, run), (codes2, scale2, c2, run2) = stored
        read_first(codes, scale[r], c, run, r, out, 0)
        read_second(codes2, scale2[r], c2, run2, r, out, first_codes)

    return decode_two


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
    matmul per stored token.  On the CPU the codes are read by the row kernels (:mod:`niah.kv.rowkernels`), all
    stages in one pass; elsewhere through :meth:`rotated`, with torch."""

    stages: tuple[_Stage, ...]
    rot: torch.Tensor  # Pi: (H, K, d) or (B, H, K, d), K the stages' codes per vector together

    @classmethod
    def mse(cls, codes: torch.Tensor, norm: torch.Tensor, bits: int, rot: torch.Tensor) -> "_CodeBlock":
        """One ``TurboQuant_mse`` stage of ``rot.shape[-2]`` codes per vector."""
        return cls((_mse_stage(codes, norm, bits, rot.shape[-2]),), rot)

    def _row_args(self) -> tuple:
        return tuple((rowkernels.rows(st.codes), rowkernels.rows(st.scale), st.table.numpy(), plane_run(st.size)) for st in self.stages)

    def _decoder(self):
        return _block_row(tuple((st.bits, st.size) for st in self.stages))

    def rotated(self) -> torch.Tensor:
        """The stored vectors in the ``Pi`` basis: float32 ``(B, H, T, K)``.  With torch, each stage's codes
        come from :func:`unpack_planes`, then a table lookup."""
        if rowkernels.usable(self.stages[0].codes):
            return rowkernels.dequantize(self._decoder(), self._row_args(), (*self.stages[0].codes.shape[:-1], self.rot.shape[-2]))
        parts = [st.table[unpack_planes(st.codes, st.bits, st.size).to(torch.int32)] * st.scale.float()[..., None] for st in self.stages]
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


@dataclass
class TurboQuantMSE(_Turbo):
    """``TurboQuant_mse`` at ``bits`` bits per coordinate (Algorithm 1)."""

    name: str = "turbo3"
    bits: int = 3
    tokenwise = True

    def analytical_bits(self, head_dim: int) -> float:
        return self.bits + 16 / head_dim

    def quantize(self, x: torch.Tensor) -> Packed:
        self._check(x)
        b, h, t, d = x.shape
        [(codes, norm)] = _mse_encode(x, self._matrices("rot", d, h, x.device), (self.bits,))
        tensors = {"codes": codes, "norm": _norm16(norm)}
        return Packed(tensors, tuple(x.shape), x.dtype, {"method": self.name})

    def _block(self, p: Packed) -> _CodeBlock:
        codes = p.tensors["codes"]
        return _CodeBlock.mse(codes, p.tensors["norm"], self.bits, self._matrices("rot", p.shape[-1], p.shape[1], codes.device))


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
        codes, signs = torch.empty(b, h, t, d * mb // 8, dtype=torch.uint8), torch.empty(b, h, t, d // 8, dtype=torch.uint8)
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
        stages = _mse_stage(codes, norm, self.bits - 1, d), _Stage(p.tensors["signs"], qjl_scale, _SIGNS.to(codes.device), 1)
        return _CodeBlock(stages, _prod_basis(self.seed, self.layer_idx, d, h, str(codes.device)))


_SIGNS = torch.from_numpy(_padded(np.array([-1.0, 1.0]), 16))  # the values of QJL sign bits 0 and 1, as a stage's table


@functools.lru_cache(maxsize=128)
def _split_basis(seed: int, layer_idx: int, packed_mask: bytes, shape: tuple[int, int, int], device: str) -> torch.Tensor:
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


for _b in (2, 3, 4):
    register(f"turbo{_b}")(lambda b=_b: TurboQuantMSE(f"turbo{b}", bits=b))
    register(f"turbo{_b}_prod")(lambda b=_b: TurboQuantProd(f"turbo{b}_prod", bits=b))
register("turbo2.5")(lambda: TurboQuantSplit("turbo2.5", bits_hi=3, bits_lo=2))
register("turbo3.5")(lambda: TurboQuantSplit("turbo3.5", bits_hi=4, bits_lo=3))
