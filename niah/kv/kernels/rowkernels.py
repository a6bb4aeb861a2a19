"""CPU kernels (numba) that read a packed KV chunk one stored vector at a time, never materializing it.

A format supplies one ``@njit`` row decoder, ``decode_row(stored, r, out)``: it writes the ``D`` float32 values of
stored row ``r`` (rows are ``(batch, kv_heads, tokens)`` flattened, token fastest) into ``out``, from ``stored``, a
tuple of numpy arrays whose first dim indexes rows (codes, scales, norms) plus any tables and constants.
:func:`kernels` turns it into three loops that decode rows into a small buffer that stays in L1 (four rows at a
time) and use them at once:

* ``scores(stored, q, out)``: ``q: (BH, G, D)`` -> ``out: (BH, G, T)``, the dot product of every query head with
  every stored key;
* ``weighted_sum(stored, w, out)``: ``w: (BH, G, T)`` -> ``out: (BH, G, D)``, ``sum_t w_t v_t``;
* ``dequantize(stored, out)``: ``out: (R, D)``, every row.

They compile at first use in a process, once per (decoder, kernel) pair.  Why numba, and how to write decoders that
vectorize: docs/design-notes.md#niah.kv.kernels.rowkernels.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

# reassociation lets LLVM vectorize the sums; no contraction into FMAs, so a decoder's ``code * scale + zero``
# rounds twice, as the torch path does
_JIT = {"fastmath": {"reassoc", "nsz"}, "boundscheck": False, "nogil": True}
DECODER = {**_JIT, "inline": "always"}  # the options of a row decoder

ENABLED = True  # False: every format reads through its torch path (the tests compare the two)


class RowKernels(NamedTuple):
    scores: object
    weighted_sum: object
    dequantize: object


_ROWS = 4  # stored rows decoded per iteration of scores and weighted_sum (their loop bodies name each of them)


@functools.lru_cache(maxsize=None)
def kernels(decode_row) -> RowKernels:
    """The three loops of the module docstring for one row decoder (compiled lazily, at first call).

    ``scores`` and ``weighted_sum`` decode four rows at a time and use each query element, or each
    accumulator of the sum, for all of them at once: a weighted sum loads and stores its ``G x D`` accumulators
    once per 4 rows instead of once per row.  Against one row at a time, 4 rows made the weighted sum faster and
    the scores faster or no slower, across q8_0, q4_0, fp8, KIVI and TurboQuant; 8 rows gave no more (measure
    with ``python -m niah bench kv``)."""

    @njit(**_JIT)
    def scores(stored, q, out):
        heads, groups, dim = q.shape
        tokens = out.shape[2]
        whole = tokens - tokens % _ROWS
        rows = np.empty((_ROWS, dim), np.float32)
        for h in range(heads):
            for t in range(0, whole, _ROWS):
                for i in range(_ROWS):
                    decode_row(stored, h * tokens + t + i, rows[i])
                for g in range(groups):
                    a0, a1, a2, a3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
                    for j in range(dim):
                        qj = q[h, g, j]
                        a0 += qj * rows[0, j]
                        a1 += qj * rows[1, j]
                        a2 += qj * rows[2, j]
                        a3 += qj * rows[3, j]
                    out[h, g, t], out[h, g, t + 1], out[h, g, t + 2], out[h, g, t + 3] = a0, a1, a2, a3
            for t in range(whole, tokens):
                decode_row(stored, h * tokens + t, rows[0])
                for g in range(groups):
                    acc = np.float32(0.0)
                    for j in range(dim):
                        acc += q[h, g, j] * rows[0, j]
                    out[h, g, t] = acc

    @njit(**_JIT)
    def weighted_sum(stored, w, out):
        heads, groups, tokens = w.shape
        dim = out.shape[2]
        whole = tokens - tokens % _ROWS
        rows = np.empty((_ROWS, dim), np.float32)
        out[:] = 0.0
        for h in range(heads):
            for t in range(0, whole, _ROWS):
                for i in range(_ROWS):
                    decode_row(stored, h * tokens + t + i, rows[i])
                for g in range(groups):
                    w0, w1, w2, w3 = w[h, g, t], w[h, g, t + 1], w[h, g, t + 2], w[h, g, t + 3]
                    for j in range(dim):
                        out[h, g, j] += w0 * rows[0, j] + w1 * rows[1, j] + w2 * rows[2, j] + w3 * rows[3, j]
            for t in range(whole, tokens):
                decode_row(stored, h * tokens + t, rows[0])
                for g in range(groups):
                    wt = w[h, g, t]
                    for j in range(dim):
                        out[h, g, j] += wt * rows[0, j]

    @njit(**_JIT)
    def dequantize(stored, out):
        for r in range(out.shape[0]):
            decode_row(stored, r, out[r])

    return RowKernels(scores, weighted_sum, dequantize)


@njit(**DECODER)
def plane_words(codes, r, run_index, bits, run):
    """For decoders of :func:`niah.kv.packing.pack_planes` codes (``bits`` <= 4, runs of ``run`` codes): the
    planes of run ``run_index`` of row ``r`` as four uint32 words, bit ``j`` of word ``k`` being bit ``k`` of
    lane ``j``'s code (words past ``bits`` are 0)."""
    size = run // 8  # bytes per plane
    first = run_index * bits * size
    w0 = _le_word(codes, r, first, size)
    w1 = _le_word(codes, r, first + size, size) if bits > 1 else np.uint32(0)
    w2 = _le_word(codes, r, first + 2 * size, size) if bits > 2 else np.uint32(0)
    w3 = _le_word(codes, r, first + 3 * size, size) if bits > 3 else np.uint32(0)
    return w0, w1, w2, w3


@njit(**DECODER)
def lane_bits(w0, w1, w2, w3, lane):
    """Bits 0-3 of lane ``lane``'s code, from the words of :func:`plane_words` (uint32 0 or 1 each)."""
    j = np.uint32(lane)
    return w0 >> j & np.uint32(1), w1 >> j & np.uint32(1), w2 >> j & np.uint32(1), w3 >> j & np.uint32(1)


@njit(**DECODER)
def set_lane_bits(w0, w1, w2, w3, b0, b1, b2, b3, lane):
    """The inverse of :func:`lane_bits`: the words with bit ``lane`` set to ``b0 .. b3`` (each 0 or 1, clear in
    the words before).  Every result is cast back to uint32: numba widens integer arithmetic to 64 bits, which
    made LLVM vectorize the encoders' lanes 4 at a time instead of 8, slowing them."""
    j = np.uint32(lane)
    return (
        np.uint32(w0 | np.uint32(np.uint32(b0) << j)),
        np.uint32(w1 | np.uint32(np.uint32(b1) << j)),
        np.uint32(w2 | np.uint32(np.uint32(b2) << j)),
        np.uint32(w3 | np.uint32(np.uint32(b3) << j)),
    )


@njit(**DECODER)
def nibble(w0, w1, w2, w3, index):
    """4-bit code ``index`` (0-31, low nibble of each byte first) of the 16 bytes held in four little-endian uint32
    words (a 32-value block of ``pack_bits(codes, 4)`` or ggml's q4_0, read by ``plane_words(codes, r, block, 4,
    32)``), as uint32.  Lane-dependent selects and shifts, no table: a 32-lane loop over a block vectorizes."""
    i = np.uint32(index)
    lo = w1 if i & np.uint32(8) else w0
    hi = w3 if i & np.uint32(8) else w2
    word = hi if i & np.uint32(16) else lo
    return word >> (i & np.uint32(7)) * np.uint32(4) & np.uint32(15)


@njit(**DECODER)
def store_planes(out, r, run_index, bits, run, w0, w1, w2, w3):
    """The inverse of :func:`plane_words`: write the ``bits`` plane words of run ``run_index`` into row ``r`` of
    ``out`` (uint8)."""
    size = run // 8
    first = run_index * bits * size
    for i in range(size):
        shift = np.uint32(8 * i)
        out[r, first + i] = w0 >> shift & np.uint32(255)
        if bits > 1:
            out[r, first + size + i] = w1 >> shift & np.uint32(255)
        if bits > 2:
            out[r, first + 2 * size + i] = w2 >> shift & np.uint32(255)
        if bits > 3:
            out[r, first + 3 * size + i] = w3 >> shift & np.uint32(255)


@functools.lru_cache(maxsize=None)
def plane_packer(bits: int, run: int):
    """``pack(codes, out)``: uint8 codes ``(R, n)`` -> ``out: uint8 (R, n * bits / 8)`` in the bit planes of
    :func:`niah.kv.packing.pack_planes` (``bits`` <= 4 and ``run`` compile-time constants, so that the lanes
    vectorize)."""

    @njit(boundscheck=False, nogil=True)
    def pack(codes, out):
        for r in range(codes.shape[0]):
            for block in range(codes.shape[1] // run):
                w0, w1, w2, w3 = np.uint32(0), np.uint32(0), np.uint32(0), np.uint32(0)
                for j in range(run):  # one pass sets a bit in every plane
                    c = np.uint32(codes[r, block * run + j])
                    w0, w1, w2, w3 = set_lane_bits(w0, w1, w2, w3, c & 1, c >> 1 & 1, c >> 2 & 1, c >> 3 & 1, j)
                store_planes(out, r, block, bits, run, w0, w1, w2, w3)

    return pack


@njit(**DECODER)
def _le_word(codes, r, first, count):
    """Bytes ``first .. first + count - 1`` of row ``r`` as a little-endian uint32."""
    word = np.uint32(0)
    for i in range(count):
        word |= np.uint32(codes[r, first + i]) << np.uint32(8 * i)
    return word


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels may read ``t``: it is on the CPU and :data:`ENABLED` is set."""
    return ENABLED and t.device.type == "cpu"


_TORCH_HALF_FROM = 4096  # fp16 arrays of at least this many values go to float32 through torch (see rows)


def rows(t: torch.Tensor) -> np.ndarray:
    """A stored tensor ``(B, H, T, ...)`` as a numpy array ``(B*H*T, ...)`` (a view where it is contiguous; fp16
    becomes float32, which numba computes with).  Numpy reshapes: a decode step makes a few of these per stored
    chunk, and torch's per-op overhead was most of a small chunk's read time.  fp16 goes to float32 through
    numpy below :data:`_TORCH_HALF_FROM` values and through torch above it (for a few values torch's per-call
    overhead dominates; for many, torch's cast is vectorized and numpy's is not)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.view(torch.uint8)
    elif t.dtype == torch.float16 and t.numel() >= _TORCH_HALF_FROM:
        t = t.float()
    a = _array(t)
    a = a.reshape(-1, *a.shape[3:])
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _array(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of ``t`` (inference only: no gradient flows through the kernels)."""
    return np.ascontiguousarray(t.detach().numpy())


def scores(decode_row, stored: tuple, q: torch.Tensor, tokens: int) -> torch.Tensor:
    """``q: (B, H, G, D)`` float32 -> ``(B, H, G, tokens)``: the query against every stored row."""
    b, h, g, d = q.shape
    out = np.empty((b * h, g, tokens), np.float32)
    kernels(decode_row).scores(stored, _array(q).reshape(b * h, g, d), out)
    return torch.from_numpy(out).view(b, h, g, tokens)


def weighted_sum(decode_row, stored: tuple, w: torch.Tensor, dim: int) -> torch.Tensor:
    """``w: (B, H, G, T)`` float32 -> ``(B, H, G, dim)``: the weighted sum of the stored rows."""
    b, h, g, t = w.shape
    out = np.empty((b * h, g, dim), np.float32)
    kernels(decode_row).weighted_sum(stored, _array(w).reshape(b * h, g, t), out)
    return torch.from_numpy(out).view(b, h, g, dim)


def dequantize(decode_row, stored: tuple, shape: tuple[int, ...]) -> torch.Tensor:
    """Every stored row, float32 ``shape = (B, H, T, D)``."""
    out = np.empty((math.prod(shape[:-1]), shape[-1]), np.float32)
    kernels(decode_row).dequantize(stored, out)
    return torch.from_numpy(out).view(shape)
