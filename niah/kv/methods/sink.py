"""Attention-sink tokens kept raw: ``+sink<N>`` stores the first ``N`` tokens of a layer at full precision.

Many models park attention on their first tokens, whose keys are outliers a low-bit codec spends its range on.
KVQuant keeps 1 such token raw (arXiv 2401.18079), SKVQ 5 (2405.06219), KVTC 4.  :class:`Sink` wraps a key or value
quantizer: the first block a layer stores (the prefill) keeps its first ``n`` tokens as ``sink``, ``(B, H, n, D)``
fp16 (the reference cache's precision), counted in bytes, and codes the rest with ``inner``; later blocks are
``inner``'s alone.  Such blocks no longer join along the token axis, so the wrapper is not ``tokenwise``: each decode
step stays a chunk of its own (a few per question here).  Measurements: docs/kv-methods.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..base import KVQuantizer, Packed

SINK = "sink"


@dataclass
class Sink(KVQuantizer):
    """``inner`` after the first ``n`` tokens of the first block, which are kept raw.  Stored: ``inner``'s tensors
    (the first block: for its tokens after the first ``n``) plus, in the first block, ``sink: fp16 (B, H, n, D)``."""

    inner: KVQuantizer
    n: int = 4

    def __post_init__(self):
        self.name = f"{self.inner.name}+sink{self.n}"
        self.residual, self.token_group, self.tokenwise = self.inner.residual, self.inner.token_group, False

    def for_layer(self, layer_idx: int) -> Sink:
        return replace(self, inner=self.inner.for_layer(layer_idx))

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)

    def analytical_bits(self, head_dim: int) -> float:
        return self.inner.analytical_bits(head_dim)  # plus n raw tokens once per layer

    def quantize(self, x: torch.Tensor) -> Packed:
        n = min(self.n, x.shape[-2] - 1)  # the inner codec gets at least one token to choose its parameters from
        p = self.inner.quantize(x[..., n:, :])
        return Packed({**p.tensors, SINK: x[..., :n, :].half()}, tuple(x.shape), x.dtype, {**p.meta, SINK: n})

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        return self.inner.quantize_after(x, self._inner(prev))

    @staticmethod
    def _inner(p: Packed) -> Packed:
        """The inner codec's block: ``p`` itself, or, for the first block, its tokens after the sink."""
        if SINK not in p.meta:
            return p
        n, b, h, t, d = p.meta[SINK], *p.shape
        meta = {k: v for k, v in p.meta.items() if k != SINK}
        return Packed({k: v for k, v in p.tensors.items() if k != SINK}, (b, h, t - n, d), p.dtype, meta)

    def dequantize(self, p: Packed) -> torch.Tensor:
        rest = self.inner.dequantize(self._inner(p))
        return torch.cat([p.tensors[SINK].to(rest.dtype), rest], dim=-2) if SINK in p.tensors else rest

    def scores(self, p: Packed, q: torch.Tensor) -> torch.Tensor:
        rest = self.inner.scores(self._inner(p), q)
        return torch.cat([q @ p.tensors[SINK].float().transpose(-1, -2), rest], dim=-1) if SINK in p.tensors else rest

    def weighted_sum(self, p: Packed, w: torch.Tensor) -> torch.Tensor:
        if SINK not in p.tensors:
            return self.inner.weighted_sum(p, w)
        n = p.tensors[SINK].shape[-2]
        return w[..., :n] @ p.tensors[SINK].float() + self.inner.weighted_sum(self._inner(p), w[..., n:])
