"""TurboQuant's row decoders (numba, :mod:`.rowkernels`): ``scale * c(codes)`` of one stored row, for one stage of
``bits``-bit codes (Lloyd-Max centroids, or QJL's ``+-1``) or two stages one after the other in the row.

Codes are ``uint8 (R, k * bits / 8)`` in the bit planes of :func:`niah.kv.packing.pack_planes`, ``R = B H T`` rows;
each stage's table holds its code values padded to 16.  :class:`niah.kv.methods.turbo_base._CodeBlock` reads
through them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ..packing import plane_run
from . import rowkernels


@functools.lru_cache(maxsize=None)
def _planes_reader(bits: int, run: int):
    """``read(codes, scale, c, run_at_run_time, r, out, offset)``: writes ``scale * c(codes of row r)`` into
    ``out[offset:]``, for ``bits``-bit codes in the bit planes of :func:`~niah.kv.packing.pack_planes`, runs of ``run``
    codes, the centroids ``c`` padded to 16 entries.  Each lane of a run shifts its bit out of every plane and picks its
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
                # bottom-up, one level of selects at a time (see turbo_encode._row_encoder)
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
    """The row decoder (:mod:`.rowkernels`) of a :class:`~niah.kv.methods.turbo_base._CodeBlock` with one or two
    stages of ``(bits, codes per vector)``: ``stored`` holds one ``(codes, scale, table, run)`` per stage, and the
    stages' values follow one another in the row (one pass over the rows, not one per stage: a pass per stage
    re-reads the rows, which made ``TurboQuant_prod``'s reads slower)."""
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
