"""A transformers ``Cache`` that keeps only packed tensors plus a full-precision residual window.

Each layer holds ``chunks``: a list of (packed keys, packed values) blocks, and ``res_k, res_v``: the newest
tokens in full precision, ``(batch, kv_heads, tokens, head_dim)``.  Whenever the residual grows past
``method.residual + method.token_group`` tokens, its oldest whole groups are quantized into a new chunk.
With ``residual = 0`` and ``token_group = 1`` (q8_0, q4_0, fp8...) every token is quantized as soon as it is
stored, as llama.cpp does, so even the question's own tokens are read back quantized.  Every chunk after the
first is stored by ``quantize_after(tokens, previous chunk)``: a per-head parameter chosen from the first chunk
(the prefill, in the needle protocol) is kept for the rest of the layer.  For ``tokenwise``
formats the newest two chunks are merged while the older one is no longer than the newer (a binary counter) or
shorter than :data:`MERGE_BELOW` tokens.  ``n`` decode steps leave ``O(log n)`` chunks, each token is copied
``O(log n)`` times plus at most :data:`MERGE_BELOW` tokens' codes per step, and a step after a long prefill reads
two chunks, the prefill's and one tail (:mod:`niah.kv.attend`): every chunk costs a fixed ~0.05-0.1 ms of Python
per read (one-off timings here), more than copying a few hundred tokens' codes.

Reading a layer dequantizes its chunks, except in one-token decode steps of a cache made with
``fused_decode=True`` inside :func:`fused_decoding`: there attention reads the stored chunks one by one
(:mod:`niah.kv.attend`) and no dequantized copy of the whole cache is built.  ``keep_dequantized=True`` memoizes the dequantized chunks
(the numbers are identical; quality runs use it for speed); it is *not* storage, and :meth:`nbytes`
never counts it.  The decode-speed benchmark runs with ``keep_dequantized=False``: every step
dequantizes the whole stored cache, the real decode path.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .attend import FUSE_MIN_TOKENS, decode_attention
from .base import concat_tokens
from .registry import KVMethod

FUSED = "niah_packed"  # the attention implementation that reads PackedLayer codes in decode steps
MERGE_BELOW = 256  # tokens: a chunk shorter than this absorbs the next one (tokenwise formats)


class PackedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self, method: KVMethod, layer_idx: int, keep_dequantized: bool = True, fused_decode: bool = False):
        super().__init__()
        self.method = method
        self.fused_decode = fused_decode
        self.kq = method.key.for_layer(layer_idx)
        self.vq = method.value.for_layer(layer_idx)
        self.keep_dequantized = keep_dequantized
        self.chunks: list = []
        self.res_k = self.res_v = None
        self._deq: tuple[torch.Tensor, torch.Tensor] | None = None  # the first tokens, dequantized (memo)

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.res_k = key_states[..., :0, :]
        self.res_v = value_states[..., :0, :]
        self.is_initialized = True

    def clone(self) -> "PackedLayer":
        """A copy that shares the (immutable) packed chunks and residual tensors."""
        other = PackedLayer.__new__(PackedLayer)
        other.__dict__.update(self.__dict__)
        other.chunks = list(self.chunks)
        return other

    def _flush(self) -> None:
        group, keep = self.method.token_group, self.method.residual
        n = self.res_k.shape[-2] - keep
        n -= n % group
        if n <= 0:
            return
        k, v = self.res_k[..., :n, :], self.res_v[..., :n, :]
        if self.chunks:
            prev_k, prev_v = self.chunks[-1]
            self.chunks.append((self.kq.quantize_after(k, prev_k), self.vq.quantize_after(v, prev_v)))
        else:
            self.chunks.append((self.kq.quantize(k), self.vq.quantize(v)))
        self.res_k, self.res_v = self.res_k[..., n:, :].contiguous(), self.res_v[..., n:, :].contiguous()
        if self.kq.tokenwise and self.vq.tokenwise:
            while len(self.chunks) > 1 and self.chunks[-2][0].shape[-2] <= max(self.chunks[-1][0].shape[-2], MERGE_BELOW - 1):
                (k0, v0), (k1, v1) = self.chunks[-2:]
                self.chunks[-2:] = [(concat_tokens(k0, k1), concat_tokens(v0, v1))]

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every chunk, dequantized: ``(B, H, T_chunks, D)`` each."""
        memo = self._deq if self.keep_dequantized else None
        done = 0 if memo is None else memo[0].shape[-2]
        ks, vs = ([memo[0]], [memo[1]]) if done else ([], [])
        start = 0
        for k, v in self.chunks:
            n = k.shape[-2]
            if start + n > done:  # a merged chunk may begin inside the memo: drop what it already holds
                skip = max(done - start, 0)
                ks.append(self.kq.dequantize(k)[..., skip:, :])
                vs.append(self.vq.dequantize(v)[..., skip:, :])
            start += n
        if not ks:
            return self.res_k[..., :0, :], self.res_v[..., :0, :]
        deq = (torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)) if len(ks) > 1 else (ks[0], vs[0])
        if self.keep_dequantized:
            self._deq = deq
        return deq

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.res_k = torch.cat([self.res_k, key_states], dim=-2)
        self.res_v = torch.cat([self.res_v, value_states], dim=-2)
        self._flush()
        if self.fused_decode and key_states.shape[-2] == 1:
            return self, self  # read by packed_attention (one decode step), not dequantized
        dk, dv = self._dequantized()
        return torch.cat([dk, self.res_k], dim=-2), torch.cat([dv, self.res_v], dim=-2)

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(k.shape[2] for k, _ in self.chunks) + self.res_k.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> tuple[int, int]:
        """(packed bytes, full-precision residual bytes) that this layer stores."""
        packed = sum(k.nbytes() + v.nbytes() for k, v in self.chunks)
        res = 0 if self.res_k is None else self.res_k.numel() * self.res_k.element_size() * 2
        return packed, res


class PackedCache(Cache):
    """One :class:`PackedLayer` per decoder layer."""

    def __init__(self, method: KVMethod, num_layers: int, keep_dequantized: bool = True, fused_decode: bool = False):
        super().__init__(layers=[PackedLayer(method, i, keep_dequantized, fused_decode) for i in range(num_layers)])
        self.method = method

    @classmethod
    def from_kv(cls, kv: list[tuple[torch.Tensor, torch.Tensor]], method: KVMethod, keep_dequantized: bool = True, fused_decode: bool = False) -> "PackedCache":
        """Store a prefilled context (per layer ``(keys, values)``, each ``(batch, kv_heads, tokens, head_dim)``)."""
        cache = cls(method, len(kv), keep_dequantized, fused_decode)
        for layer, (k, v) in zip(cache.layers, kv):
            layer.update(k, v)
        return cache

    def clone(self) -> "PackedCache":
        other = PackedCache.__new__(PackedCache)
        other.__dict__.update(self.__dict__)
        other.layers = [layer.clone() for layer in self.layers]
        return other

    def nbytes(self) -> dict[str, int]:
        """Stored bytes summed over layers: ``packed``, ``residual`` (full precision) and ``total``."""
        packed = sum(layer.nbytes()[0] for layer in self.layers)
        res = sum(layer.nbytes()[1] for layer in self.layers)
        return {"packed": packed, "residual": res, "total": packed + res}


def packed_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: decode steps of a ``fused_decode`` cache read the codes; else SDPA."""
    if isinstance(key, PackedLayer):
        out = decode_attention(query, key, module.scaling if scaling is None else scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@contextlib.contextmanager
def fused_decoding(model):
    """Within the block, ``model`` attends through :func:`packed_attention` (masks as for SDPA).

    One sequence, no padding: a decode step's single query sees the whole cache, so it needs no mask.
    """
    AttentionInterface.register(FUSED, packed_attention)
    AttentionMaskInterface.register(FUSED, sdpa_mask)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    old = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = FUSED
        yield model
    finally:
        for c, impl in zip(configs, old):
            c._attn_implementation = impl


def warm_up(method: KVMethod, kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> None:
    """Compile ``method``'s kernels now (numba row kernels, compiled encoders: store, prefill-style read, decode
    step), so timings exclude it."""
    x = torch.randn(1, kv_heads, 2 * FUSE_MIN_TOKENS + 1, head_dim, device=device)
    layer = PackedLayer(method, 0, keep_dequantized=False, fused_decode=True)
    layer.update(x[..., :-1, :], x[..., :-1, :])
    layer.update(x[..., -1:, :], x[..., -1:, :])
    decode_attention(x[..., -1:, :].repeat(1, 2, 1, 1), layer, head_dim**-0.5)
