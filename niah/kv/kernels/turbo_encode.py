"""TurboQuant's CPU encoders (numba): nearest-centroid codes of rotated rows, fused with the rotation (and, for
``TurboQuant_prod``, the residual's QJL sketch) per tile of rows that stays in cache.

Rows are ``x: (R, d)`` float32, ``R = B H T`` (``(batch, kv_heads, tokens)`` flattened, token fastest); codes are
written in the bit planes of :func:`niah.kv.packing.pack_planes`.  The callers are
:mod:`niah.kv.methods.turbo_base` (``TurboQuant_mse`` and the split variants) and :mod:`niah.kv.methods.turbo_prod`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit

from ..packing import plane_run
from . import rowkernels
from .turbo_decode import _stage_reader

_TINY = torch.finfo(torch.float32).tiny  # the divisor for a zero vector, which then gets ``y = 0``


@functools.lru_cache(maxsize=None)
def _row_encoder(bits: int, run: int):
    """The CPU encoder of ``bits``-bit codes (1 to 4) in runs of ``run``, compile-time constants as in
    :func:`.turbo_decode._planes_reader`: ``encode(y, col, k, norm, mids, out)``, ``y: (R, K)`` rotated rows of which
    the ``k`` columns from ``col`` are coded, ``norm: (R, 1)``, ``mids`` the codebook's midpoints padded to 15 -> ``out:
    uint8 (R, k * bits / 8)`` in the bit planes of :func:`~niah.kv.packing.pack_planes`.  The code of ``u = y / norm``
    is the number of midpoints below it (``torch.bucketize``: the nearest centroid, ties to the lower one), found bit by
    bit, top bit first: each bit is ``u > m`` for the midpoint that splits the codes left by the bits above it.  That is
    ``bits`` comparisons and a tree of selects per value, which LLVM vectorizes (faster than counting all ``2^bits - 1``
    midpoints for 2 and 3 bits, and even for 4).  No fastmath: the division and comparisons are torch's, bit for bit."""

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
                        t0, t1, t2, t3 = (
                            (m2 if b1 else m0),
                            (m6 if b1 else m4),
                            (m10 if b1 else m8),
                            (m14 if b1 else m12),
                        )
                        t01, t23 = (t1 if b2 else t0), (t3 if b2 else t2)
                        b0 = u > (t23 if b3 else t01)
                    w0, w1, w2, w3 = rowkernels.set_lane_bits(w0, w1, w2, w3, b0, b1, b2, b3, j)
                rowkernels.store_planes(out, r, block, bits, run, w0, w1, w2, w3)

    return encode


_TILE = 1024  # rows per tile of _rotate_encoder: a 64-dim tile of x and its rotation take 0.5 MB (L2 holds 1.25 here)


@functools.lru_cache(maxsize=None)
def _rotate_encoder(bits: tuple[int, ...], run: int):
    """The CPU path of :func:`~niah.kv.methods.turbo_base._mse_encode` for one stage (``bits = (b,)``) or two (the split
    variants' halves, ``(b_hi, b_lo)``), each of ``k`` codes in runs of ``run``: ``encode(x, tokens, rot_t, mids, norm,
    out, mids2, norm2, out2)``, ``x: (R, d)`` float32 rows, ``tokens`` per (batch, head), ``rot_t: (N, d, K)`` the
    transposed matrices ``Pi`` per head (``N = H``) or per (batch, head) (``N = B H``), ``K = k len(bits)`` -> ``norm:
    (R, 1)`` and ``out`` as in :func:`_row_encoder`; the second stage's arguments likewise (a single stage passes its
    own again, unused).  Per tile of :data:`_TILE` rows of one (batch, head), BLAS rotates the tile (``np.dot``, scipy's
    sgemm) once for all stages, and each stage's norms and codes are computed from its columns while the tile is in
    cache, instead of three passes over full-size tensors.  The norms are float32 sums in numba's order
    (:func:`_sum_squares`): they can differ from torch's ``vector_norm`` in the last bit, which can move a code only
    where ``y / norm`` ties a midpoint.  The fused pass beats torch's matmul and norm followed by :func:`_row_encoder`
    at 3 bits, and the split variants' two stages (3 and 2 bits) cost no more than one 3-bit stage over the same product
    (measure with ``python -m niah bench kv``)."""
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
    """The CPU path of :meth:`~niah.kv.methods.turbo_prod.TurboQuantProd.quantize` with ``bits`` MSE bits:
    ``encode(x, rot_t, qjl_t, tokens, mids, table, norm, codes, rnorm, signs)``, ``x: (R, d)`` float32 rows of
    ``tokens`` per (batch, head), ``rot_t``, ``qjl_t: (H, d, d)`` the transposed ``Pi`` and ``S``, the codebook's
    padded midpoints and centroids -> ``norm: (R, 1)``, ``codes``, ``rnorm: (R,)`` and ``signs`` (1-bit planes).  Per
    tile of :data:`_TILE` rows, as :func:`_rotate_encoder`, then the residual ``u - c(codes)`` of each row, its norm,
    and the signs of its sketch (a second ``np.dot``), while the tile is in cache; the torch path makes a dozen
    passes over full-size tensors instead."""
    run = plane_run(dim)
    encode, read, pack_signs = _row_encoder(bits, run), _stage_reader(bits, dim), rowkernels.plane_packer(1, run)

    @njit(nogil=True)
    def prod_encode(x, rot_t, qjl_t, tokens, mids, table, norm, codes, rnorm, signs):
        y, res, sketch = (
            np.empty((_TILE, dim), np.float32),
            np.empty((_TILE, dim), np.float32),
            np.empty((_TILE, dim), np.float32),
        )
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
