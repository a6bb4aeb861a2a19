"""The packed KV cache: a transformers ``Cache`` that keeps each attention layer's context only as packed chunks
plus a full-precision residual window, and reads it back as the layer's read mode says.

:meth:`PackedCache.from_states` builds it from a prefill and a :class:`~niah.kv.spec.CacheSpec`, choosing each
layer's class once:

* :class:`PackedLayer`: the storage (chunks, flushes, merges, sliding-window drops, bytes) and ``strict`` reads,
  every pass reading every stored token back from the stored form, as llama.cpp reads its cache;
* :class:`EngineLayer`: ``engine`` reads, as vLLM's TurboQuant backend reads its cache;
* :class:`FusedDecodeLayer`, :class:`FusedEngineLayer`: the same, but a decode step attends over the stored codes
  (:func:`fused_decoding`, :mod:`niah.kv.attend`) instead of a dequantized copy of the whole layer.

Layers outside the method's :class:`~niah.kv.registry.LayerPolicy` are stored at fp16; linear-attention layers keep
their recurrent state as the model computed it.  The rules of each read mode, and why: docs/protocol.md ("Cache
layers and read modes").
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .attend import FUSE_MIN_TOKENS, decode_attention
from .base import concat_tokens
from .layout import FULL, LINEAR, SLIDING
from .registry import KVMethod, get_method
from .spec import CacheSpec

CONTINUATION_DECODE_THRESHOLD = 128  # vLLM's _CONTINUATION_DECODE_THRESHOLD (turboquant_attn.py)
FUSED = "niah_packed"  # the attention implementation that reads PackedLayer codes in decode steps
# tokens: a chunk shorter than this absorbs the next one (tokenwise formats), as every chunk costs a fixed Python
# overhead per read, more than copying a few hundred tokens' codes
MERGE_BELOW = 256


@dataclass
class LayerState:
    """One decoder layer's context as a prefill left it (:func:`niah.experiments.protocol.context_states`).

    ``kind`` is a :mod:`niah.kv.layout` layer type.  Attention layers hold ``keys`` and ``values``,
    ``(batch, kv_heads, tokens, head_dim)`` (a sliding layer: its last ``window - 1`` tokens) after reading ``seen``
    tokens; a linear-attention layer holds ``linear``, a private copy of transformers' layer with its states.
    """

    kind: str
    seen: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    window: int | None = None
    linear: LinearAttentionCacheLayerMixin | None = None


class PackedLayer(CacheLayerMixin):
    """One attention layer stored with ``method`` and read ``strict``: every pass reads every stored token back from
    the stored form, its own tokens included.

    ``chunks``: (packed keys, packed values) blocks, oldest first; ``res_k, res_v``: the newest tokens in full
    precision, ``(batch, kv_heads, tokens, head_dim)``.  Whole ``method.token_group`` groups older than the newest
    ``method.residual`` tokens are coded into a new chunk as soon as they are stored (``residual = 0``,
    ``token_group = 1``: every token is, as llama.cpp does).  Every chunk after the first is coded by
    ``quantize_after(tokens, previous chunk)``, keeping a per-head parameter chosen from the first chunk (the prefill).
    ``window``: a sliding-window layer's window; it keeps and reads its last ``window - 1`` tokens.
    ``keep_dequantized``: memoize the dequantized chunks (full-attention layers; speed only, not storage).
    """

    is_croppable = False

    def __init__(self, method: KVMethod, layer_idx: int, keep_dequantized: bool = True, window: int | None = None):
        super().__init__()
        self.method = method
        self.window = window
        self.seen = 0  # tokens this layer has read (a sliding layer keeps only the last window - 1 of them)
        self.kq = method.key.for_layer(layer_idx)
        self.vq = method.value.for_layer(layer_idx)
        self.keep_dequantized = keep_dequantized and window is None
        self.chunks: list = []
        self.res_k = self.res_v = None
        self._deq: tuple[torch.Tensor, torch.Tensor] | None = None  # the first tokens, dequantized (memo)

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    @property
    def layer_type(self) -> str:
        return SLIDING if self.is_sliding else FULL

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.res_k = key_states[..., :0, :]
        self.res_v = value_states[..., :0, :]
        self.is_initialized = True

    def clone(self) -> PackedLayer:
        """A copy of the same class that shares the (immutable) packed chunks and residual tensors."""
        other = copy.copy(self)
        other.chunks = list(self.chunks)
        return other

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the pass's new keys and values ``(batch, kv_heads, n, head_dim)``; return what it attends over, every
        visible token read back from the stored form."""
        visible = self._append(key_states, value_states)
        return self._in_window(*self._read(), visible)

    def _append(self, key_states, value_states) -> int:
        """Store new tokens; return how many tokens their pass sees (transformers' mask size)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        visible = self.get_mask_sizes(n)[0]
        self.seen += n
        self.res_k = torch.cat([self.res_k, key_states], dim=-2)
        self.res_v = torch.cat([self.res_v, value_states], dim=-2)
        self._flush()
        return visible

    def _in_window(self, k, v, visible: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass's keys and values ``k, v``: in a sliding-window layer cut to the ``visible`` newest (and the chunks
        now outside the window dropped), else as they are."""
        if self.is_sliding:
            self._drop_outside_window()
            k, v = k[..., -visible:, :], v[..., -visible:, :]
        return k, v

    def _flush(self) -> None:
        """Code the residual's oldest whole groups beyond ``method.residual`` into a new chunk.  For ``tokenwise``
        formats the newest two chunks are then merged while the older is no longer than the newer (a binary counter)
        or shorter than :data:`MERGE_BELOW`: ``n`` decode steps leave ``O(log n)`` chunks, and a step after a long
        prefill reads two, the prefill's and one tail.  A sliding layer's chunks are never merged, so that they can
        be dropped whole."""
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
        if self.kq.tokenwise and self.vq.tokenwise and not self.is_sliding:
            while len(self.chunks) > 1 and (
                self.chunks[-2][0].shape[-2] <= max(self.chunks[-1][0].shape[-2], MERGE_BELOW - 1)
            ):
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

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token, read back: ``(B, H, T, D)`` keys and values (chunks dequantized, then the residual)."""
        dk, dv = self._dequantized()
        return torch.cat([dk, self.res_k], dim=-2), torch.cat([dv, self.res_v], dim=-2)

    def end_prompt(self) -> None:
        """The prompt is read; strict reads do not change with it."""

    def _drop_outside_window(self) -> None:
        """Drop the oldest chunks while the rest still holds the last ``window - 1`` tokens."""
        while self.chunks and self.stored_tokens() - self.chunks[0][0].shape[-2] >= self.window - 1:
            self.chunks.pop(0)

    def stored_tokens(self) -> int:
        return sum(k.shape[2] for k, _ in self.chunks) + (self.res_k.shape[-2] if self.is_initialized else 0)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.seen + query_length, 0
        if self.seen >= self.window:  # as transformers' DynamicSlidingWindowLayer
            return self.window - 1 + query_length, self.seen - self.window + 1
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> tuple[int, int]:
        """(packed bytes, full-precision residual bytes) that this layer stores."""
        packed = sum(k.nbytes() + v.nbytes() for k, v in self.chunks)
        res = 0 if self.res_k is None else self.res_k.numel() * self.res_k.element_size() * 2
        return packed, res


class FusedDecodeLayer(PackedLayer):
    """A full-attention :class:`PackedLayer` whose decode steps (one-token passes) return the layer itself: inside
    :func:`fused_decoding`, :func:`packed_attention` then scores its stored chunks one by one (:mod:`niah.kv.attend`)
    and no dequantized copy of the whole layer is built."""

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] != 1:
            return super().update(key_states, value_states)
        self._append(key_states, value_states)
        return self, self


class EngineLayer(PackedLayer):
    """A :class:`PackedLayer` read ``engine``: as vLLM's TurboQuant backend (``vllm/v1/attention/backends/
    turboquant_attn.py``, vLLM 0.34.0), which stores every token before attention, then reads, per forward pass:

    * within the prompt's first chunk (passes that end by token ``raw_until``), the raw keys and values;
    * in a later pass of more than :data:`CONTINUATION_DECODE_THRESHOLD` tokens, the earlier tokens dequantized and its
      own raw (``_continuation_prefill``);
    * in a shorter pass, and in decode steps, everything from the stored form (the decode kernel), as strict reads.

    ``raw_until``: the prompt's chunk, or 0 when the stored context is a cached prefix (a prefix-cache hit).  ``raw``:
    the raw keys and values the first chunk has read so far (the prefill's activations in flight, not storage).
    """

    def __init__(self, method: KVMethod, layer_idx: int, keep_dequantized: bool, window: int | None, raw_until: int):
        super().__init__(method, layer_idx, keep_dequantized, window)
        self.raw_until = raw_until
        self.raw: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        first_chunk = self.seen + n <= self.raw_until
        if first_chunk:
            earlier = self.raw  # what the chunk's earlier passes read, raw
        elif n > CONTINUATION_DECODE_THRESHOLD:  # a continuation prefill: the tokens stored before it, dequantized
            earlier, self.raw = (self._read() if self.is_initialized else None), None
        else:  # a short continuation or a decode step: vLLM's decode kernel reads the stored form, as strict reads
            self.raw = None
            return super().update(key_states, value_states)
        visible = self._append(key_states, value_states)
        k, v = key_states, value_states
        if earlier is not None:
            k, v = torch.cat([earlier[0], k], dim=-2), torch.cat([earlier[1], v], dim=-2)
        if first_chunk:  # the chunk's next pass reads them again (a sliding layer: its window)
            keep = k.shape[-2] if self.window is None else self.window - 1
            self.raw = (k[..., -keep:, :], v[..., -keep:, :])
        return self._in_window(k, v, visible)

    def end_prompt(self) -> None:
        """The prompt is read: later passes are decode steps (or a teacher-forced run of them) and read the stored
        form, as vLLM's decode kernel does."""
        self.raw_until, self.raw = min(self.raw_until, self.seen), None


class FusedEngineLayer(EngineLayer, FusedDecodeLayer):
    """An :class:`EngineLayer` whose passes that read the stored form take :class:`FusedDecodeLayer`'s path: a
    one-token one returns the layer itself (a one-token pass within the prompt's first chunk still reads raw)."""


def _layer(spec: CacheSpec, method: KVMethod, layer_idx: int, window: int | None) -> PackedLayer:
    """An empty layer of the class that reads as ``spec`` says, storing with ``method``."""
    fused = spec.fused_decode and window is None  # a sliding layer's reads are cut to its window: always dequantized
    if spec.engine_chunk is None:
        return (FusedDecodeLayer if fused else PackedLayer)(method, layer_idx, spec.keep_dequantized, window)
    raw_until = spec.engine_chunk if spec.fresh_prompt else 0  # a cached prefix: its first chunk is long over
    return (FusedEngineLayer if fused else EngineLayer)(method, layer_idx, spec.keep_dequantized, window, raw_until)


def _method_at(spec: CacheSpec, i: int, kind: str, layers: int, hybrid: bool) -> KVMethod:
    """The method layer ``i`` (of type ``kind``, in a model of ``layers`` layers) stores with: ``spec``'s where its
    layer policy stores that layer (and ``spec.sliding`` does not keep sliding layers at fp16), else fp16."""
    stored = spec.method.layers.stores(i, kind, layers, hybrid)
    return spec.method if stored and not (kind == SLIDING and spec.sliding == "fp16") else get_method("fp16")


class PackedCache(Cache):
    """One :class:`PackedLayer` per attention layer, a private copy of transformers' layer per linear-attention one,
    built by :meth:`from_states` as ``spec`` says."""

    def __init__(self, spec: CacheSpec, layers: list):
        super().__init__(layers=layers)
        self.spec = spec

    def pieces(self, ids: list[int]) -> list[list[int]]:
        """``ids``, the next tokens, in the forward passes that read them: split at multiples of the spec's
        ``engine_chunk`` (engine reads), or one pass."""
        chunk = self.spec.engine_chunk
        if chunk is None:
            return [ids]
        start, out = next(layer.seen for layer in self.layers if isinstance(layer, PackedLayer)), []
        while ids:
            take = chunk - start % chunk
            out.append(ids[:take])
            ids, start = ids[take:], start + take
        return out

    @classmethod
    def from_states(cls, states: list[LayerState], spec: CacheSpec) -> PackedCache:
        """Store a prefilled context (:func:`niah.experiments.protocol.context_states`) with ``spec.method`` in the
        layers its policy stores (and, ``spec.sliding == "fp16"``, not in sliding-window layers), the others at fp16,
        each in the layer class that reads as ``spec`` says."""
        hybrid = any(st.kind == LINEAR for st in states)
        layers = []
        for i, st in enumerate(states):
            if st.kind == LINEAR:
                layers.append(copy.deepcopy(st.linear))
                continue
            layer = _layer(spec, _method_at(spec, i, st.kind, len(states), hybrid), i, st.window)
            layer.update(st.keys, st.values)
            layer.seen = st.seen
            layers.append(layer)
        return cls(spec, layers)

    @classmethod
    def empty(cls, config, spec: CacheSpec) -> PackedCache:
        """An empty cache for a model of transformers config ``config``, its layers as :meth:`from_states` makes them
        (linear-attention layers: transformers' own, empty)."""
        plain = DynamicCache(config=config).layers  # transformers' layer types for this model, and the windows
        hybrid = any(isinstance(x, LinearAttentionCacheLayerMixin) for x in plain)
        layers = []
        for i, x in enumerate(plain):
            if isinstance(x, LinearAttentionCacheLayerMixin):
                layers.append(x)
                continue
            window = getattr(x, "sliding_window", None)
            layers.append(_layer(spec, _method_at(spec, i, SLIDING if window else FULL, len(plain), hybrid), i, window))
        return cls(spec, layers)

    def dequantize_now(self) -> None:
        """Dequantize every stored chunk now (``keep_dequantized`` layers), so that clones share the result
        instead of each dequantizing the whole context again."""
        for layer in self.layers:
            if isinstance(layer, PackedLayer) and layer.keep_dequantized:
                layer._dequantized()

    def clone(self) -> PackedCache:
        """A copy whose layers share the stored chunks (:meth:`PackedLayer.clone`)."""
        other = copy.copy(self)
        other.layers = [x.clone() if isinstance(x, PackedLayer) else copy.deepcopy(x) for x in self.layers]
        return other

    def end_prompt(self) -> None:
        """The prompt is read (:meth:`PackedLayer.end_prompt`)."""
        for layer in self.layers:
            if isinstance(layer, PackedLayer):
                layer.end_prompt()

    def nbytes(self) -> dict[str, int]:
        """Stored bytes: ``packed``, ``residual`` (full precision) and ``total`` over the attention layers, the
        ``total`` of each attention layer type (``full_attention``, ``sliding_attention``), and ``linear_state``,
        the linear-attention layers' recurrent and convolution states (not KV, never in ``total``)."""
        out = {"packed": 0, "residual": 0, "total": 0, FULL: 0, SLIDING: 0, "linear_state": 0}
        for layer in self.layers:
            if isinstance(layer, PackedLayer):
                packed, res = layer.nbytes()
                out["packed"] += packed
                out["residual"] += res
                out["total"] += packed + res
                out[layer.layer_type] += packed + res
            else:
                out["linear_state"] += linear_state_bytes(layer)
        return out


class GenerateCache(PackedCache):
    """A :class:`PackedCache` that ``model.generate()`` fills from empty (:func:`niah.kv.cache_for`): its first forward
    pass is the whole prompt and every later one a decode step.

    * ``strict``: every pass reads every stored token back from the stored form, the prompt's own tokens included, as
      llama.cpp reads its cache.  This is stricter than the battery's ``strict`` rows, whose context is prefilled
      raw and stored before the question reads it (a prefix-cache hit): :func:`niah.ask.ask` reproduces those.
    * ``engine``: the prompt reads its own raw keys and values, then decode steps read the stored form: vLLM's reads
      of a fresh prompt in one chunk, the battery's ``@engine`` rows.  A prompt longer than the chunk
      (``engine_chunk``) would need vLLM's chunked prefill, which one ``generate()`` pass is not: it is refused.
    """

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, EngineLayer):
            if layer.seen:  # the prompt was the first pass: this is a decode step, which reads the stored form
                layer.end_prompt()
            elif key_states.shape[-2] > layer.raw_until:
                raise ValueError(
                    f"a {key_states.shape[-2]}-token prompt is longer than the engine read mode's chunk "
                    f"({layer.raw_until} tokens), and vLLM would prefill it in chunks, which one generate() pass is "
                    "not: pass a larger engine_chunk to cache_for, or use niah.ask.ask, which reads in chunks"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def cache_for(model, method: str, engine_chunk: int = 16384, sliding: str = "quantize") -> GenerateCache:
    """An empty cache that ``model.generate(ids, past_key_values=cache_for(model, method))`` fills, storing with KV
    method ``method`` (a :mod:`niah.kv.registry` name) in the layers its layer policy codes, fp16 in the others, and
    reading as its read mode says (``name@engine``: vLLM's; :class:`GenerateCache` says what one ``generate()``
    prompt pass reads in each mode).  ``engine_chunk``: vLLM's ``max_num_batched_tokens`` (engine reads only);
    ``sliding``: ``"fp16"`` keeps sliding-window layers at fp16.  ``cache.nbytes()``: the stored bytes, by layer
    type.  Works for every layer type :func:`niah.experiments.protocol.context_states` takes (full, sliding-window,
    linear-attention)."""
    spec = CacheSpec.resolve(method, engine_chunk, sliding=sliding)
    refuse_static(method, spec.method)
    return GenerateCache.empty(model.config, spec)


def refuse_static(name: str, method: KVMethod) -> None:
    """Raise for a ``+static`` method: its key statistics are calibrated per model by a config's run."""
    if method.key_statistics is not None and method.key_statistics.static:
        raise ValueError(
            f"{name}: +static key statistics are calibrated per model by a config's run (niah.experiments.keystats);"
            " drop +static here (+centred and +scaled compute them from the prompt itself)"
        )


def linear_state_bytes(layer: LinearAttentionCacheLayerMixin) -> int:
    """Bytes of a linear-attention layer's convolution and recurrent states."""
    states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in states if t is not None)


def packed_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: decode steps of a :class:`FusedDecodeLayer` read its codes; else SDPA."""
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
    layer = FusedDecodeLayer(method, 0, keep_dequantized=False)
    layer.update(x[..., :-1, :], x[..., :-1, :])
    layer.update(x[..., -1:, :], x[..., -1:, :])
    decode_attention(x[..., -1:, :].repeat(1, 2, 1, 1), layer, head_dim**-0.5)
