"""Key centring: take the per-head channel mean of a layer's first stored keys out before coding them.

Attention cannot see a vector added to every key of a head: it shifts all of one query's scores by the same
``q . mu``, which softmax ignores, so a codec need not spend its levels on it.  :class:`Centred` wraps any key
quantizer: the first block a layer stores (the prefill) gives ``mu``, the mean over its tokens, ``(B, H, 1, D)``,
kept as fp16 and counted in bytes; every block codes ``x - mu`` with the inner method, and reads add ``mu`` back
(:meth:`scores` adds ``q . mu`` to the inner scores, so the row kernels still read the codes).  Later blocks reuse
the first block's ``mu`` (:meth:`quantize_after`), named in ``meta["shared"]``.  The modifier is ``+centred``
(:mod:`niah.kv.registry`); its sources: docs/kv-methods.md; why: docs/design-notes.md#niah.kv.methods.centred.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import KVQuantizer, Packed

CENTRE = "key_mean"


@dataclass
class Centred(KVQuantizer):
    """``inner`` applied to keys minus their stored per-head mean.  Stored: ``inner``'s tensors and
    ``key_mean: fp16 (B, H, 1, D)``."""

    inner: KVQuantizer

    def __post_init__(self):
        self.name = f"{self.inner.name}+centred"
        self.residual, self.token_group, self.tokenwise = (
            self.inner.residual,
            self.inner.token_group,
            self.inner.tokenwise,
        )

    def for_layer(self, layer_idx: int) -> "Centred":
        return Centred(self.inner.for_layer(layer_idx))

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)

    def analytical_bits(self, head_dim: int) -> float:
        return self.inner.analytical_bits(head_dim)  # plus 16 bits per channel once per layer, not per token

    def quantize(self, x: torch.Tensor) -> Packed:
        mu = x.float().mean(-2, keepdim=True).half()
        return self._wrap(self.inner.quantize(x - mu.to(x.dtype)), mu)

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        mu = prev.tensors[CENTRE]
        return self._wrap(self.inner.quantize_after(x - mu.to(x.dtype), self._inner(prev)), mu)

    @staticmethod
    def _wrap(p: Packed, mu: torch.Tensor) -> Packed:
        shared = (*p.meta.get("shared", ()), CENTRE)
        return Packed({**p.tensors, CENTRE: mu}, p.shape, p.dtype, {**p.meta, "shared": shared})

    @staticmethod
    def _inner(p: Packed) -> Packed:
        shared = tuple(k for k in p.meta["shared"] if k != CENTRE)
        meta = {**p.meta, "shared": shared} if shared else {k: v for k, v in p.meta.items() if k != "shared"}
        return Packed({k: v for k, v in p.tensors.items() if k != CENTRE}, p.shape, p.dtype, meta)

    def dequantize(self, p: Packed) -> torch.Tensor:
        return (self.inner.dequantize(self._inner(p)).float() + p.tensors[CENTRE].float()).to(p.dtype)

    def scores(self, p: Packed, q: torch.Tensor) -> torch.Tensor:
        return self.inner.scores(self._inner(p), q) + q @ p.tensors[CENTRE].float().transpose(-1, -2)

    def weighted_sum(self, p: Packed, w: torch.Tensor) -> torch.Tensor:
        return self.inner.weighted_sum(self._inner(p), w) + w.sum(-1, keepdim=True) * p.tensors[CENTRE].float()
