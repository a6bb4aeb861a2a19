"""How one packed cache is built and read: a KV method resolved with its read knobs (:class:`CacheSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from .registry import KVMethod, get_method

SLIDING_LAYERS = ("quantize", "fp16")  # how sliding-window layers are stored: with the method, or kept at fp16


@dataclass(frozen=True)
class CacheSpec:
    """What :meth:`~niah.kv.cache.PackedCache.from_states` needs, resolved once (:meth:`resolve`).

    ``method``: the KV method.  ``engine_chunk``: for a method read in ``engine`` mode (``name@engine``), the prompt's
    chunk in tokens (vLLM's ``max_num_batched_tokens``); None for ``strict`` methods.  ``sliding``: sliding-window
    layers stored with the method (``"quantize"``) or kept at fp16 (``"fp16"``).  ``fresh_prompt``: the stored context
    is the start of a prompt, not a cached prefix (engine reads only).  The decode path: ``fused_decode``, one-token
    passes of full-attention layers attend over the stored codes inside :func:`~niah.kv.cache.fused_decoding`;
    ``keep_dequantized``, the dequantized chunks are memoized (the same numbers, faster; never counted as storage).
    """

    method: KVMethod
    engine_chunk: int | None = None
    sliding: str = "quantize"
    fresh_prompt: bool = True
    fused_decode: bool = False
    keep_dequantized: bool = True

    def __post_init__(self):
        if self.sliding not in SLIDING_LAYERS:
            raise ValueError(f"unknown sliding-layer storage {self.sliding!r}: choose {' or '.join(SLIDING_LAYERS)}")
        engine = self.method.read_mode == "engine"
        if engine and not self.engine_chunk:
            raise ValueError(
                f"{self.method.name} reads the cache as vLLM does and needs the prompt's chunk size (niah.engine_chunk)"
            )
        if not engine and self.engine_chunk is not None:
            raise ValueError(f"{self.method.name} reads the cache strictly: it takes no prompt chunk (engine_chunk)")

    @classmethod
    def resolve(cls, name: str, engine_chunk: int | None = None, **knobs) -> CacheSpec:
        """The spec of KV method ``name`` (:func:`~niah.kv.registry.get_method`): ``engine_chunk`` is kept for a
        method read in ``engine`` mode only; ``knobs``: the other fields."""
        method = get_method(name)
        return cls(method, engine_chunk if method.read_mode == "engine" else None, **knobs)
