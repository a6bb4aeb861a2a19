"""Dense bit packing of small integer codes along the last dim, in two layouts.

:func:`pack_bits`: the codes of a row form one little-endian bit stream.  Code ``i`` occupies stream bits
``[i * bits, (i + 1) * bits)``, least significant bit first, and byte ``k`` holds stream bits ``[8k, 8k + 8)``, also
least significant first: for ``bits`` in {1, 2, 4, 8} byte ``j`` holds codes ``j*m .. j*m + m - 1``
(``m = 8 // bits``), first code lowest (for 4 bits, ``byte = c[2j] | c[2j+1] << 4``); for ``bits = 3`` each run of
8 codes is one 24-bit word ``c0 | c1 << 3 | ... | c7 << 21``, stored as 3 bytes, low byte first, and for ``bits = 6``
each run of 4 codes one 24-bit word likewise (5 and 7 bits would need 40- and 56-bit words: not supported).  A row of
``n`` codes is padded with zero codes to a whole number of groups (``8 // gcd(8, bits)`` codes), so it takes
``ceil(n / group) * bytes_per_group`` bytes; :func:`unpack_bits` needs ``n`` to drop the padding.

:func:`pack_planes`: bit planes, for the formats whose codes the CPU row kernels read in SIMD lanes (TurboQuant,
KIVI, the sliding-window quantizer); its docstring gives the layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kernels import rowkernels

SUPPORTED_BITS = (1, 2, 3, 4, 6, 8)  # a group of codes fits one int32 word


def _layout(bits: int) -> tuple[int, int]:
    """``(codes per group, bytes per group)`` for ``bits``-bit codes."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"pack_bits supports bits in {SUPPORTED_BITS}; got {bits}")
    group = 8 // math.gcd(8, bits)
    return group, group * bits // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes: uint8 (..., n)``, every value ``< 2**bits`` (not checked)
    -> ``uint8 (..., ceil(n / group) * bytes_per_group)``."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_bits takes uint8 codes; got {codes.dtype}")
    group, nbytes = _layout(bits)
    slots = F.pad(codes, (0, -codes.shape[-1] % group)).unflatten(-1, (-1, group)).to(torch.int32)
    word = slots[..., 0]
    for s in range(1, group):
        word = word | slots[..., s] << s * bits
    return (word[..., None] >> _shifts(8, nbytes, word.device) & 255).to(torch.uint8).flatten(-2)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``packed: uint8 (..., bytes)`` -> ``codes: uint8 (..., n)``.  Each group's
    bytes form one int32 word, and code ``s`` of the group is ``word >> (s * bits) & mask``."""
    group, nbytes = _layout(bits)
    if packed.shape[-1] != -(-n // group) * nbytes:
        raise ValueError(f"{packed.shape[-1]} bytes do not hold {n} codes of {bits} bits")
    groups = packed.unflatten(-1, (-1, nbytes)).to(torch.int32)
    word = groups[..., 0]
    for i in range(1, nbytes):
        word = word | groups[..., i] << 8 * i
    codes = word[..., None] >> _shifts(bits, group, word.device) & (1 << bits) - 1
    return codes.flatten(-2)[..., :n].to(torch.uint8)


def plane_run(n: int) -> int:
    """The run length of :func:`pack_planes` for rows of ``n`` codes: 32, 16 or 8."""
    if n % 8:
        raise ValueError(f"bit planes take a multiple of 8 codes per row; got {n}")
    return 32 if n % 32 == 0 else 16 if n % 16 == 0 else 8


def pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes: uint8 (..., n)``, ``n`` a multiple of 8, every value ``< 2**bits`` (not checked) ->
    ``uint8 (..., n * bits / 8)`` in bit planes.

    The ``n`` codes of a row form runs of ``m`` codes, ``m`` the largest of 32, 16 and 8 that divides ``n``
    (:func:`plane_run`).  A run takes ``bits`` planes of ``m / 8`` bytes, plane ``k`` first; byte ``i`` of plane
    ``k`` holds bit ``k`` of codes ``8i .. 8i + 7`` of the run, code ``8i + s`` at bit ``s``.  Read as a
    little-endian ``m``-bit integer, plane ``k`` holds bit ``k`` of code ``s`` at bit ``s``, so one shift per lane
    decodes a whole run.  The same ``n * bits / 8`` bytes as :func:`pack_bits`; for ``bits = 1`` the two layouts
    are the same.
    """
    _layout(bits)
    run = plane_run(codes.shape[-1])
    if bits <= 4 and rowkernels.usable(codes):  # numba, one pass: several times faster than the ops below
        out = torch.empty(*codes.shape[:-1], codes.shape[-1] * bits // 8, dtype=torch.uint8)
        rows = codes.reshape(-1, codes.shape[-1]).contiguous().numpy()
        rowkernels.plane_packer(bits, run)(rows, out.view(-1, out.shape[-1]).numpy())
        return out
    runs = codes.unflatten(-1, (-1, run)).unsqueeze(-2).to(torch.int32)
    planes = runs >> _shifts(1, bits, codes.device)[:, None] & 1  # (..., runs, bits, m)
    octets = planes.unflatten(-1, (-1, 8)) << _shifts(1, 8, codes.device)
    return octets.sum(-1).to(torch.uint8).flatten(-3)


def unpack_planes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: ``packed: uint8 (..., n * bits / 8)`` -> ``codes: uint8 (..., n)``."""
    _layout(bits)
    if packed.shape[-1] * 8 != n * bits:
        raise ValueError(f"{packed.shape[-1]} bytes do not hold {n} codes of {bits} bits")
    octets = packed.unflatten(-1, (-1, bits, plane_run(n) // 8)).to(torch.int32)
    planes = (octets[..., None] >> _shifts(1, 8, packed.device) & 1).flatten(-2)  # (..., runs, bits, m)
    return (planes << _shifts(1, bits, packed.device)[:, None]).sum(-2).to(torch.uint8).flatten(-2)


def _shifts(step: int, count: int, device: torch.device) -> torch.Tensor:
    """int32 ``[0, step, ..., (count - 1) * step]``: the bit offsets of the fields of one word."""
    return torch.arange(0, count * step, step, dtype=torch.int32, device=device)
