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
two chunks, the prefill's and one tail (:mod:`niah.kv.attend`): every chunk costs a fixed Python overhead per
read, more than copying a few hundred tokens' codes.

Read modes (``method.read_mode``, :mod:`niah.kv.registry`).  ``strict``: every read goes through the stored
form, the question's own tokens included, as llama.cpp reads its cache.  ``engine``: vLLM's TurboQuant backend
(``vllm/v1/attention/backends/turboquant_attn.py``, vLLM 0.34.0), which stores every token before attention and
then reads, per forward pass of ``n`` new tokens (a chunk of the prompt, of at most ``engine_chunk`` tokens, or a
decode step):

* within a prompt's first chunk, the raw keys and values (its prefill attends over what it just computed);
* in a later chunk of more than :data:`CONTINUATION_DECODE_THRESHOLD` tokens, the earlier tokens dequantized and
  its own tokens raw (``_continuation_prefill``);
* in a chunk of at most that many tokens, and in decode steps, everything from the stored form (the decode kernel).

:meth:`PackedCache.from_states` with ``fresh_prompt=True`` stores a context as the first tokens of a prompt: until
a pass reaches ``engine_chunk`` tokens, the layer keeps their raw keys and values besides the stored form (the
activations of the prefill in flight, not counted as storage) and reads them.  ``fresh_prompt=False`` stores it as
a cached prefix (a prefix-cache hit).  Callers split passes at multiples of ``engine_chunk``
(:meth:`PackedCache.pieces`).

A method's layer policy (:class:`~niah.kv.registry.LayerPolicy`) picks the layers it stores; the others get fp16.

A sliding-window layer (``window`` set) keeps only what transformers' sliding layers keep, the last
``window - 1`` tokens: it is read back that far, and a chunk is dropped once every one of its tokens is older
than that (its chunks are never merged, so they can be dropped whole).  A linear-attention layer's recurrent
state is kept as the model computed it, in a private copy of transformers' layer (:class:`PackedCache`).

Reading a layer dequantizes its chunks, except in one-token decode steps of a cache made with
``fused_decode=True`` inside :func:`fused_decoding`: there attention reads the stored chunks one by one
(:mod:`niah.kv.attend`) and no dequantized copy of the whole cache is built.  ``keep_dequantized=True`` memoizes the dequantized chunks
(the numbers are identical; quality runs use it for speed); it is *not* storage, and :meth:`nbytes`
never counts it.  The decode-speed benchmark runs with ``keep_dequantized=False``: every step
dequantizes the whole stored cache, the real decode path.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .attend import FUSE_MIN_TOKENS, decode_attention
from .base import concat_tokens
from .layout import FULL, LINEAR, SLIDING
from .registry import KVMethod, get_method

CONTINUATION_DECODE_THRESHOLD = 128  # vLLM's _CONTINUATION_DECODE_THRESHOLD (turboquant_attn.py)
FUSED = "niah_packed"  # the attention implementation that reads PackedLayer codes in decode steps
MERGE_BELOW = 256  # tokens: a chunk shorter than this absorbs the next one (tokenwise formats)


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
    is_croppable = False

    def __init__(
        self,
        method: KVMethod,
        layer_idx: int,
        keep_dequantized: bool = True,
        fused_decode: bool = False,
        window: int | None = None,
        raw_until: int | None = None,
    ):
        super().__init__()
        self.raw_until = raw_until  # engine reads: raw keys and values for passes that end by this token (None: strict reads)
        self.raw: tuple[torch.Tensor, torch.Tensor] | None = None  # those raw keys and values, while a pass may read them
        self.method = method
        self.window = window
        self.is_sliding = window is not None
        self.seen = 0  # tokens this layer has read (a sliding layer keeps only the last window - 1 of them)
        self.fused_decode = fused_decode and window is None
        self.kq = method.key.for_layer(layer_idx)
        self.vq = method.value.for_layer(layer_idx)
        self.keep_dequantized = keep_dequantized and window is None
        self.chunks: list = []
        self.res_k = self.res_v = None
        self._deq: tuple[torch.Tensor, torch.Tensor] | None = None  # the first tokens, dequantized (memo)

    @property
    def layer_type(self) -> str:
        return SLIDING if self.is_sliding else FULL

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
        if self.kq.tokenwise and self.vq.tokenwise and not self.is_sliding:
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
        n = key_states.shape[-2]
        visible = self.get_mask_sizes(n)[0]
        reads = self._engine_reads(n)
        if reads == "own_raw":  # the tokens stored before this pass, dequantized, then its own raw ones
            before = self._read()
        self.seen += n
        self.res_k = torch.cat([self.res_k, key_states], dim=-2)
        self.res_v = torch.cat([self.res_v, value_states], dim=-2)
        self._flush()
        if self.fused_decode and n == 1:
            return self, self  # read by packed_attention (one decode step), not dequantized
        if reads == "raw":
            k, v = key_states, value_states
            if self.raw is not None:
                k, v = torch.cat([self.raw[0], k], dim=-2), torch.cat([self.raw[1], v], dim=-2)
            keep = k.shape[-2] if self.window is None else self.window - 1
            self.raw = (k[..., -keep:, :], v[..., -keep:, :])
        elif reads == "own_raw":
            k, v = torch.cat([before[0], key_states], dim=-2), torch.cat([before[1], value_states], dim=-2)
        else:
            k, v = self._read()
        if self.is_sliding:
            self._drop_outside_window()
            k, v = k[..., -visible:, :], v[..., -visible:, :]
        return k, v

    def _read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token, read back: ``(B, H, T, D)`` keys and values (chunks dequantized, then the residual)."""
        dk, dv = self._dequantized()
        return torch.cat([dk, self.res_k], dim=-2), torch.cat([dv, self.res_v], dim=-2)

    def _engine_reads(self, n: int) -> str:
        """How a pass of ``n`` new tokens reads this layer: ``raw``, ``own_raw`` or ``stored`` (module docstring)."""
        if self.raw_until is None:
            return "stored"
        if self.seen + n <= self.raw_until:
            return "raw"
        self.raw = None  # the prompt's first chunk is over
        return "own_raw" if n > CONTINUATION_DECODE_THRESHOLD else "stored"

    def end_prompt(self) -> None:
        """The prompt is read: later passes are decode steps (or a teacher-forced run of them) and, in engine
        mode, read the stored form, as vLLM's decode kernel does."""
        if self.raw_until is not None:
            self.raw_until, self.raw = min(self.raw_until, self.seen), None

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


SLIDING_LAYERS = ("quantize", "fp16")  # how sliding-window layers are stored: with the method, or kept at fp16


class PackedCache(Cache):
    """One :class:`PackedLayer` per attention layer, a private copy of transformers' layer per linear-attention one.

    ``sliding="fp16"`` keeps sliding-window layers at fp16 and stores only full-attention layers with the method;
    the default ``"quantize"`` stores every attention layer with it.
    """

    def __init__(self, method: KVMethod, layers: list, engine_chunk: int | None = None):
        super().__init__(layers=layers)
        self.method = method
        self.engine_chunk = engine_chunk  # engine reads: the prompt's chunk size (None: strict reads)

    def pieces(self, ids: list[int]) -> list[list[int]]:
        """``ids``, the next tokens, in the forward passes that read them: split at multiples of ``engine_chunk``
        (engine reads), or one pass."""
        if self.engine_chunk is None:
            return [ids]
        start, out = next(layer.seen for layer in self.layers if isinstance(layer, PackedLayer)), []
        while ids:
            take = self.engine_chunk - start % self.engine_chunk
            out.append(ids[:take])
            ids, start = ids[take:], start + take
        return out

    @classmethod
    def from_states(
        cls,
        states: list[LayerState],
        method: KVMethod,
        keep_dequantized: bool = True,
        fused_decode: bool = False,
        sliding: str = "quantize",
        engine_chunk: int | None = None,
        fresh_prompt: bool = True,
    ) -> "PackedCache":
        """Store a prefilled context (:func:`niah.experiments.protocol.context_states`) with ``method``, in the layers
        its policy stores (and, ``sliding="fp16"``, not in sliding-window layers); the others at fp16.  A method read in
        ``engine`` mode needs ``engine_chunk``; ``fresh_prompt``: the context is the start of a prompt, not a cached prefix."""
        if sliding not in SLIDING_LAYERS:
            raise ValueError(f"unknown sliding-layer storage {sliding!r}: choose {' or '.join(SLIDING_LAYERS)}")
        engine = method.read_mode == "engine"
        if engine and not engine_chunk:
            raise ValueError(f"{method.name} reads the cache as vLLM does and needs the prompt's chunk size (niah.engine_chunk)")
        hybrid = any(st.kind == LINEAR for st in states)
        layers = []
        for i, st in enumerate(states):
            if st.kind == LINEAR:
                layers.append(copy.deepcopy(st.linear))
                continue
            stored = method.layers.stores(i, st.kind, len(states), hybrid) and not (st.kind == SLIDING and sliding == "fp16")
            raw_until = (engine_chunk if fresh_prompt else 0) if engine else None
            layer = PackedLayer(method if stored else get_method("fp16"), i, keep_dequantized, fused_decode, st.window, raw_until)
            layer.update(st.keys, st.values)
            layer.seen = st.seen
            layers.append(layer)
        return cls(method, layers, engine_chunk if engine else None)

    def dequantize_now(self) -> None:
        """Dequantize every stored chunk now (``keep_dequantized`` layers), so that clones share the result
        instead of each dequantizing the whole context again."""
        for layer in self.layers:
            if isinstance(layer, PackedLayer) and layer.keep_dequantized:
                layer._dequantized()

    def clone(self) -> "PackedCache":
        other = PackedCache.__new__(PackedCache)
        other.__dict__.update(self.__dict__)
        other.layers = [layer.clone() if isinstance(layer, PackedLayer) else copy.deepcopy(layer) for layer in self.layers]
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


def linear_state_bytes(layer: LinearAttentionCacheLayerMixin) -> int:
    """Bytes of a linear-attention layer's convolution and recurrent states."""
    states = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in states if t is not None)


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
