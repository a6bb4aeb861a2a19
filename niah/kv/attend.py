"""One decode step of attention read straight from the packed cache, without a dequantized copy of it.

The plain decode path dequantizes every stored chunk into a full-precision tensor and then attends: for
q8_0 that reads 1 byte per value, writes 4 and reads the 4 back.  Here each quantizer scores the query
against its own codes and sums the values from their codes (:meth:`KVQuantizer.scores`,
:meth:`KVQuantizer.weighted_sum`); the methods that override them (q8_0, q4_0, fp8, TurboQuant-MSE) do it from
the codes, in loops compiled by ``torch.compile`` (on the CPU: C++ loops with OpenMP).

* q8_0 / q4_0: ``q . k = sum over blocks of scale * (q_block . codes)``; the codes are unpacked inside the
  fused loop.
* fp8: one scale per chunk and head, so ``q . k = scale * (q . float(codes))``.
* TurboQuant-MSE: ``k = ||k|| Pi^T c`` with ``c`` the centroids of the codes, so ``q . k = (Pi q) . (||k|| c)``:
  one compiled loop turns the codes into ``||k|| c`` (the vectors in the rotated basis, no rotation), the query
  is rotated once per step, and scores and the weighted sum of values are matmuls against ``||k|| c``; the sum
  is rotated back once (one ``d x d`` matmul per step instead of one per token).  Unlike the other methods this
  writes a float copy of the chunk in the rotated basis during the step (inductor's loops that fused the
  lookups into the dot products ran slower here).

Quantizers also run their encoders (and fp8 its decoder) through :func:`fused_or_eager`: one compiled loop
instead of several passes over fresh full-size tensors.

The numbers are the same as attending over the dequantized cache up to float32 summation order (the tests
check it).  Where ``torch.compile`` cannot run (no C++ compiler), the same functions run eagerly, with one
warning; an error that the eager run raises too (a real bug, such as a shape mismatch) is raised.
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
    made the 3-bit unpacking loop 7x slower here (27 ms against 3.8 ms for 16K tokens x 3 heads).  Each bit
    width, fp8 format and head size is one more specialization, hence a recompile limit above dynamo's 8 (past
    it, a function silently runs eagerly)."""
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
            warnings.warn(f"torch.compile failed ({_compile_error}); fused KV kernels run eagerly (slower)", stacklevel=2)
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
        out += layer.vq.weighted_sum(v, weights[..., start:start + n])
        start += n
    if res_v.shape[-2]:
        out += weights[..., start:] @ res_v
    return out.view(b, hq, 1, d).to(query.dtype)
