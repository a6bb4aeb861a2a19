"""One decode step of attention read chunk by chunk from the packed cache, without a dequantized copy of it.

Each stored chunk is scored and summed on its own (:meth:`KVQuantizer.scores`, :meth:`KVQuantizer.weighted_sum`)
and the softmax runs over the joined scores.  On the CPU every quantized format reads its codes through the numba
loops of :mod:`niah.kv.kernels.rowkernels` (TurboQuant in its rotated basis); elsewhere (fp16 and bf16, other
devices) a chunk is dequantized into a temporary.  The numbers are those of attending over the dequantized cache up
to float32 summation order (the tests check it).

:func:`fused` and :func:`fused_or_eager` run the encoders of q8_0 and fp8 through ``torch.compile``; where it cannot
run (no C++ compiler) they run eagerly, with one warning, and an error the eager run raises too is raised.
See docs/design-notes.md#niah.kv.attend.
"""

from __future__ import annotations

import functools
import warnings

import torch

FUSE_MIN_TOKENS = 64  # inputs shorter than this (the one-token chunks of decode steps) run eagerly, uncompiled


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    """``fn`` compiled with automatic dynamic shapes: a dim that changes between calls (the token count) becomes
    a symbol after the first recompile, the rest (head_dim, block and group sizes) stay constants and give
    vectorized loops.  Python ints (bit widths) are always constants: as symbols, under ``dynamic=True``, they
    made the 3-bit unpacking loop much slower.  Each bit width, fp8 format and head size is one more
    specialization, hence a recompile limit above dynamo's 8 (past it, a function silently runs eagerly)."""
    return torch._dynamo.config.patch(specialize_int=True, recompile_limit=64)(torch.compile(fn))


_compile_error: str | None = None  # set at the first compile failure; later calls run eagerly


def fused(fn, *args):
    """``fn(*args)`` through ``torch.compile``, or eagerly where compiling fails here (warned once).

    A compile failure is told apart from a bug in ``fn`` by running ``fn`` eagerly: if that raises too, the
    error is the eager one and propagates.
    """
    global _compile_error
    if _compile_error is None:
        try:
            return _compiled(fn)(*args)
        except Exception as err:  # a missing or broken C++ toolchain surfaces as many different exception types
            out = fn(*args)  # raises if the bug is in fn itself
            _compile_error = f"{type(err).__name__}: {str(err)[:200]}"
            warnings.warn(
                f"torch.compile failed ({_compile_error}); fused KV kernels run eagerly (slower)", stacklevel=2
            )
            return out
    return fn(*args)


def fused_or_eager(fn, *args, tokens: int):
    """``fn(*args)``: compiled (:func:`fused`) for inputs of at least :data:`FUSE_MIN_TOKENS` tokens, else eagerly
    (the same function, so the same numbers up to float rounding order)."""
    return fused(fn, *args) if tokens >= FUSE_MIN_TOKENS else fn(*args)


def decode_attention(query: torch.Tensor, layer, scaling: float) -> torch.Tensor:
    """Attention of ``query: (B, Hq, 1, d)`` over everything a :class:`~niah.kv.cache.PackedLayer` stores.

    Returns ``(B, Hq, 1, d)`` in the query's dtype.  ``Hq`` must be a multiple of the cache's KV heads
    (grouped-query attention).  No mask: one new token of one sequence sees the whole cache.
    """
    b, hq, _, d = query.shape
    hkv = layer.res_k.shape[1]
    q = query.float().view(b, hkv, hq // hkv, d) * scaling  # (B, Hkv, G, d)
    scores = [layer.kq.scores(k, q) for k, _ in layer.chunks]
    res_k, res_v = layer.res_k.float(), layer.res_v.float()
    if res_k.shape[-2]:
        scores.append(q @ res_k.transpose(-1, -2))
    weights = torch.cat(scores, dim=-1).softmax(dim=-1)  # (B, Hkv, G, T)
    out, start = torch.zeros_like(q), 0
    for _, v in layer.chunks:
        n = v.shape[-2]
        out += layer.vq.weighted_sum(v, weights[..., start : start + n])
        start += n
    if res_v.shape[-2]:
        out += weights[..., start:] @ res_v
    return out.view(b, hq, 1, d).to(query.dtype)
