"""Per-channel key statistics taken out before coding: centring (``+centred``) and a per-channel scale (``+scaled``).

Attention cannot see a vector added to every key of a head: it shifts all of one query's scores by the same
``q . mu``, which softmax ignores, so a codec need not spend its levels on it.  A per-channel scale ``s`` evens out
channels of very different size before the inner codec (before TurboQuant's rotation), and ``q . (s * y) =
(q * s) . y`` lets reads stay on the codes.  :class:`KeyAffine` wraps any key quantizer and codes
``y = (x - mu) / s`` (``mu = 0`` without centring, ``s = 1`` without scaling); reads give ``s * y + mu``.

Where the statistics come from:

* per prompt (the default): the first block a layer stores (the prefill) gives ``mu``, its mean over tokens, and
  ``s``, the root mean square over tokens of ``x - mu``, each ``(B, H, 1, D)``; later blocks reuse them
  (:meth:`quantize_after`), named in ``meta["shared"]``;
* ``+static``: calibrated once per model on held-out text (:mod:`niah.experiments.keystats`), as an engine would deploy
  them, for it stores a prompt's first chunk before it has seen the rest; passed in as ``stats``.

Either way they are kept as fp16, ``key_mean`` and ``key_scale``, and counted in bytes.  Published as: NSNQuant's
"Shift" (arXiv 2505.18231), SageAttention's ``smooth_k`` (2410.02367), KVQuant's per-channel key zero-point
(2401.18079) and llama.cpp fork PrismML-Eng/llama.cpp#51 (centring); VecInfer's "smooth" (2510.06175) and KIVI's
per-channel keys (2402.02750) (scales).  Credits and measurements: docs/kv-methods.md; why:
docs/design-notes.md#niah.kv.methods.affine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..base import KVQuantizer, Packed

MEAN, SCALE = "key_mean", "key_scale"
TINY = 1e-4  # the smallest channel scale: a channel that never moves is coded as it is


@dataclass(frozen=True)
class KeyStats:
    """One model's key statistics per attention layer, from a calibration prefill: ``mean[i]`` and ``meansq[i]``,
    float32 ``(H, D)``, the mean of keys and of their squares over the calibration tokens of layer ``i``."""

    mean: dict[int, torch.Tensor]
    meansq: dict[int, torch.Tensor]

    def of(self, layer_idx: int, centre: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, s)`` of layer ``layer_idx``, ``(1, H, 1, D)`` fp16: the mean (zeros unless ``centre``) and the
        root mean square of the keys minus it."""
        if layer_idx not in self.mean:
            raise ValueError(f"the key statistics have no layer {layer_idx}: they were calibrated on another model")
        mean, meansq = self.mean[layer_idx], self.meansq[layer_idx]
        mu = mean if centre else torch.zeros_like(mean)
        s = (meansq - 2 * mu * mean + mu * mu).clamp_min(0).sqrt().clamp_min(TINY)
        return mu[None, :, None].half(), s[None, :, None].half()


@dataclass
class KeyAffine(KVQuantizer):
    """``inner`` applied to ``(x - mu) / s``.  ``centre``: take out the per-channel mean; ``scale``: divide by the
    per-channel scale; ``static``: the statistics come from ``stats`` (:class:`KeyStats`, set by
    :func:`niah.experiments.keystats.with_key_stats`), else from each prompt's first block.  Stored: ``inner``'s
    tensors plus ``key_mean`` (with ``centre``) and ``key_scale`` (with ``scale``), fp16 ``(B, H, 1, D)``."""

    inner: KVQuantizer
    centre: bool = False
    scale: bool = False
    static: bool = False
    stats: KeyStats | None = None
    layer_idx: int | None = None

    def __post_init__(self):
        mods = [m for m, on in (("centred", self.centre), ("scaled", self.scale), ("static", self.static)) if on]
        self.name = "+".join([self.inner.name, *mods])
        self.residual, self.token_group, self.tokenwise = (
            self.inner.residual,
            self.inner.token_group,
            self.inner.tokenwise,
        )

    def for_layer(self, layer_idx: int) -> KeyAffine:
        if self.static and self.stats is None:
            raise ValueError(
                f"{self.name} reads per-model key statistics, and none were given: build its cache through "
                "niah.experiments.specs.cache_spec(cfg, name, lm), which calibrates them (niah.experiments.keystats)"
            )
        return replace(self, inner=self.inner.for_layer(layer_idx), layer_idx=layer_idx)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)

    def analytical_bits(self, head_dim: int) -> float:
        return self.inner.analytical_bits(head_dim)  # plus 16 bits per channel and statistic once per layer

    def _statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, s)``, fp16 ``(B, H, 1, D)``, for a layer's first block ``x``."""
        if self.static:
            mu, s = self.stats.of(self.layer_idx, self.centre)
            return mu.expand(x.shape[0], -1, -1, -1).to(x.device), s.expand(x.shape[0], -1, -1, -1).to(x.device)
        xf = x.float()
        mu = xf.mean(-2, keepdim=True) if self.centre else torch.zeros_like(xf[..., :1, :])
        s = (xf - mu).square().mean(-2, keepdim=True).sqrt().clamp_min(TINY) if self.scale else torch.ones_like(mu)
        return mu.half(), s.half()

    def quantize(self, x: torch.Tensor) -> Packed:
        return self._code(x, *self._statistics(x), None)

    def quantize_after(self, x: torch.Tensor, prev: Packed) -> Packed:
        return self._code(x, *self._shared(prev), self._inner(prev))

    def _code(self, x: torch.Tensor, mu: torch.Tensor, s: torch.Tensor, prev: Packed | None) -> Packed:
        y = ((x.float() - mu.float()) / s.float()).to(x.dtype)
        p = self.inner.quantize(y) if prev is None else self.inner.quantize_after(y, prev)
        kept = {MEAN: mu} if self.centre else {}
        kept |= {SCALE: s} if self.scale else {}
        shared = (*p.meta.get("shared", ()), *kept)
        return Packed({**p.tensors, **kept}, p.shape, p.dtype, {**p.meta, "shared": shared} if shared else p.meta)

    def _shared(self, p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, s)`` as ``p`` stores them (zeros and ones for what it does not take out)."""
        like = next(iter(p.tensors.values()))
        shape, dev = (p.shape[0], p.shape[1], 1, p.shape[3]), like.device
        mu = p.tensors[MEAN] if self.centre else torch.zeros(shape, dtype=torch.float16, device=dev)
        s = p.tensors[SCALE] if self.scale else torch.ones(shape, dtype=torch.float16, device=dev)
        return mu, s

    @staticmethod
    def _inner(p: Packed) -> Packed:
        shared = tuple(k for k in p.meta.get("shared", ()) if k not in (MEAN, SCALE))
        meta = {k: v for k, v in p.meta.items() if k != "shared"} | ({"shared": shared} if shared else {})
        return Packed({k: v for k, v in p.tensors.items() if k not in (MEAN, SCALE)}, p.shape, p.dtype, meta)

    def dequantize(self, p: Packed) -> torch.Tensor:
        mu, s = self._shared(p)
        return (self.inner.dequantize(self._inner(p)).float() * s.float() + mu.float()).to(p.dtype)

    def scores(self, p: Packed, q: torch.Tensor) -> torch.Tensor:
        """``q . (s * y + mu) = (q * s) . y + q . mu``: the inner codec reads its own codes."""
        mu, s = self._shared(p)
        out = self.inner.scores(self._inner(p), q * s.float())
        return out + q @ mu.float().transpose(-1, -2) if self.centre else out

    def weighted_sum(self, p: Packed, w: torch.Tensor) -> torch.Tensor:
        mu, s = self._shared(p)
        return self.inner.weighted_sum(self._inner(p), w) * s.float() + w.sum(-1, keepdim=True) * mu.float()
