"""Integer quantizers: round-to-nearest group-wise weights and dynamic per-token activations.

Weights ``w: (out, in)`` are quantized in groups of ``group`` consecutive input channels (``group=-1``: one group per
output row, i.e. per channel), with fp16 scales ``(out, in // group)``:

* symmetric: auto-round's ``int_sym`` rule, so that round-to-nearest here equals AutoRound at zero iterations: the
  value of largest magnitude in a group maps to ``-2**(bits-1)`` exactly, codes lie in
  ``[-2**(bits-1), 2**(bits-1) - 1]`` (no zero point);
* asymmetric: ``scale = (max(w, 0) - min(w, 0)) / (2**bits - 1)``, an integer zero point per group, codes in
  ``[0, 2**bits - 1]`` (auto-round's ``int_asym``, AutoAWQ's zero-point layout).

Activations ``x: (..., in)`` are quantized per token, dynamically (a fresh scale for every token): symmetric
``scale = max|x| / (2**(bits-1) - 1)``, or asymmetric with a zero point.  On this CPU there is no integer kernel
behind this: it is quantize-dequantize, and every result that uses it says ``simulated``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SCALE = 1e-5


@dataclass
class QWeight:
    """Codes of one weight matrix: ``codes`` uint8 ``(out, groups, group)`` (signed codes offset by
    ``2**(bits-1)``), ``scale`` fp16 ``(out, groups)``, ``zero`` uint8 ``(out, groups)`` for asymmetric, else None."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int

    @property
    def offset(self) -> torch.Tensor | int:
        return self.zero[..., None].float() if self.zero is not None else 2 ** (self.bits - 1)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``(out, in)``."""
        w = (self.codes.float() - self.offset) * self.scale.float()[..., None]
        return w.reshape(w.shape[0], -1)


def grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """``(out, in)`` -> ``(out, in // group, group)``; a clear error when ``in`` is not a multiple of ``group``."""
    out, inp = w.shape
    g = inp if group == -1 else group
    if inp % g:
        raise ValueError(
            f"{inp} input channels are not a multiple of group {g}: "
            f"use a divisor of {inp} (e.g. 64 or 32 for 576) or -1"
        )
    return w.reshape(out, inp // g, g)


def quantize_weight(w: torch.Tensor, bits: int, group: int = 64, sym: bool = True) -> QWeight:
    """Round-to-nearest codes of ``w: (out, in)``."""
    if not 2 <= bits <= 8:
        raise ValueError(f"weight bits must be 2..8; got {bits}")
    x = grouped(w.detach().float(), group)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    if sym:
        nmax = 2 ** (bits - 1)
        extreme = torch.where(hi < -lo, -lo, -hi)  # the larger side, signed so that it maps to -nmax
        scale = (extreme / nmax).half().float()
        # the scale carries the extreme's sign (negative when the positive side is larger): keep it off zero both ways
        scale = torch.where(scale < 0, scale.clamp(max=-MIN_SCALE), scale.clamp(min=MIN_SCALE))
        q = torch.round(x / scale[..., None]).clamp(-nmax, nmax - 1)
        return QWeight((q + nmax).to(torch.uint8), scale.half(), None, bits)
    maxq = 2**bits - 1
    scale = ((hi - lo) / maxq).half().float().clamp(min=MIN_SCALE)
    zero = torch.round(-lo / scale).clamp(0, maxq)
    q = (torch.round(x / scale[..., None]) + zero[..., None]).clamp(0, maxq)
    return QWeight(q.to(torch.uint8), scale.half(), zero.to(torch.uint8), bits)


def fake_quant_weight(w: torch.Tensor, bits: int, group: int = 64, sym: bool = True) -> torch.Tensor:
    """Quantize-dequantize ``w: (out, in)`` -> fp32 ``(out, in)``."""
    return quantize_weight(w, bits, group, sym).dequantize()


def fake_quant_tokens(x: torch.Tensor, bits: int, sym: bool = True) -> torch.Tensor:
    """Dynamic per-token quantize-dequantize of ``x: (..., channels)``: one scale (and zero point) per token.

    The error per value is at most half a step: ``max|x| / (2 * (2**(bits-1) - 1))`` symmetric,
    ``(max(x, 0) - min(x, 0)) / (2 * (2**bits - 1))`` asymmetric.
    """
    v = x.float()
    if sym:
        qmax = 2 ** (bits - 1) - 1
        scale = v.abs().amax(-1, keepdim=True).clamp(min=1e-8) / qmax
        out = torch.round(v / scale).clamp(-qmax, qmax) * scale
    else:
        maxq = 2**bits - 1
        lo, hi = v.amin(-1, keepdim=True).clamp(max=0), v.amax(-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-8)
        zero = torch.round(-lo / scale)
        out = ((torch.round(v / scale) + zero).clamp(0, maxq) - zero) * scale
    return out.to(x.dtype)
