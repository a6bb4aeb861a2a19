"""Dense bit packing of small integer codes along the last dim.

Layout: the codes of a row form one little-endian bit stream.  Code ``i`` occupies stream bits
``[i * bits, (i + 1) * bits)``, least significant bit first, and byte ``k`` holds stream bits
``[8k, 8k + 8)``, also least significant first.  Concretely:

* ``bits`` in {1, 2, 4, 8}: byte ``j`` holds codes ``j*m .. j*m + m - 1`` (``m = 8 // bits``), the first code in
  the lowest bits: ``byte = c[jm] | c[jm+1] << bits | ...``.  For 4 bits, ``byte = c[2j] | c[2j+1] << 4``.
* ``bits = 3``: each run of 8 codes is one 24-bit word ``c0 | c1 << 3 | ... | c7 << 21``, stored as 3 bytes,
  low byte first.

A row of ``n`` codes is padded with zero codes to a whole number of such groups (``8 // gcd(8, bits)`` codes:
8 for 1 and 3 bits, 4 for 2 bits, 2 for 4 bits, 1 for 8 bits), so it takes ``ceil(n / group) * bytes_per_group``
bytes; :func:`unpack_bits` needs ``n`` to drop the padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def _layout(bits: int) -> tuple[int, int]:
    """``(codes per group, bytes per group)`` for ``bits``-bit codes."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack_bits supports bits in {SUPPORTED_BITS}; got {bits}")
    group = 8 // math.gcd(8, bits)
    return group, group * bits // 8


def _pieces(bits: int):
    """``(slot, byte, shift)`` for each piece of a code that lands in one byte of its group.

    Code ``slot`` of a group starts at bit ``slot * bits`` of the group's stream; its piece in byte ``byte`` sits
    ``shift = slot * bits - 8 * byte`` bits up in that byte (negative: the code's low ``-shift`` bits are in the
    byte before).
    """
    group, _ = _layout(bits)
    for slot in range(group):
        start = slot * bits
        for byte in range(start // 8, (start + bits - 1) // 8 + 1):
            yield slot, byte, start - 8 * byte


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes: uint8 (..., n)``, every value ``< 2**bits`` (not checked)
    -> ``uint8 (..., ceil(n / group) * bytes_per_group)``."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_bits takes uint8 codes; got {codes.dtype}")
    group, nbytes = _layout(bits)
    slots = F.pad(codes, (0, -codes.shape[-1] % group)).unflatten(-1, (-1, group))  # (..., groups, group)
    out = torch.zeros(*slots.shape[:-1], nbytes, dtype=torch.uint8, device=codes.device)
    for slot, byte, shift in _pieces(bits):  # uint8 shifts drop the bits that belong to the next byte
        out[..., byte] |= slots[..., slot] << shift if shift >= 0 else slots[..., slot] >> -shift
    return out.flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``packed: uint8 (..., bytes)`` -> ``codes: uint8 (..., n)``."""
    return unpack_codes(packed, bits, n).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """:func:`unpack_bits` as int32 codes, in plain tensor ops that ``torch.compile`` fuses into its consumer.

    Each code is assembled from its pieces (:func:`_pieces`) with constant shifts on int16 copies of the bytes.
    """
    group, nbytes = _layout(bits)
    if packed.shape[-1] != -(-n // group) * nbytes:
        raise ValueError(f"{packed.shape[-1]} bytes do not hold {n} codes of {bits} bits")
    groups = packed.unflatten(-1, (-1, nbytes)).to(torch.int16)
    codes = [None] * group
    for slot, byte, shift in _pieces(bits):
        piece = groups[..., byte] >> shift if shift >= 0 else groups[..., byte] << -shift
        codes[slot] = piece if codes[slot] is None else codes[slot] | piece
    return (torch.stack(codes, dim=-1) & ((1 << bits) - 1)).flatten(-2)[..., :n].to(torch.int32)
