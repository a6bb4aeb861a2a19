"""What each decoder layer of a model keeps between tokens, and how many bytes that is.

Three layer types are handled, named as transformers' ``config.layer_types`` names them:

* ``full_attention``: keys and values of every token (the KV cache proper);
* ``sliding_attention``: keys and values of the last ``sliding_window - 1`` tokens only (Gemma 3, Mistral);
* ``linear_attention``: a fixed-size recurrent and convolution state, no per-token keys or values (Qwen3.5's
  Gated DeltaNet layers).  It is left as the model computed it, counted on its own and never called KV.

A model without ``layer_types`` has full attention in every layer.  Any other layer type stops with an error
that names the types this repo can store.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)


class UnsupportedLayout(ValueError):
    """A model's layers cannot be stored here, or not at the asked context length; the message names the fix."""


@dataclass(frozen=True)
class CacheLayout:
    """Per-layer storage of one model: ``layer_types[i]`` is one of :data:`LAYER_TYPES`."""

    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding_window of the sliding layers (tokens attended, the new one included)
    linear_state: int = 0  # values of one linear-attention layer's convolution and recurrent states

    @classmethod
    def from_config(cls, config) -> "CacheLayout":
        """The layout of a transformers model config (its text config for multimodal models)."""
        c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = tuple(getattr(c, "layer_types", None) or [FULL] * c.num_hidden_layers)
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise UnsupportedLayout(
                f"layer type(s) {bad} of {c.model_type} cannot be stored by this repo's cache (it stores "
                f"{', '.join(LAYER_TYPES)}): pick a model whose layers are of those types"
            )
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        window = getattr(c, "sliding_window", None) if SLIDING in types else None
        linear = 0
        if LINEAR in types:  # Gated DeltaNet: a causal conv over q, k and v, and one d_k x d_v state per value head
            nk, nv, dk, dv = (
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
            )
            linear = (2 * nk * dk + nv * dv) * c.linear_conv_kernel_dim + nv * dk * dv
        return cls(types, c.num_key_value_heads, head_dim, window, linear)

    def count(self, kind: str) -> int:
        return sum(t == kind for t in self.layer_types)

    def stored_tokens(self, kind: str, tokens: int) -> int:
        """Tokens a layer of type ``kind`` keeps after reading a ``tokens``-token context."""
        if kind == FULL:
            return tokens
        if kind == SLIDING:
            return min(tokens, self.window - 1)
        return 0

    def kv_values(self, tokens: int) -> dict[str, int]:
        """Stored key and value entries per attention layer type, summed over layers, for a ``tokens`` context."""
        per_token = 2 * self.kv_heads * self.head_dim
        return {k: self.count(k) * self.stored_tokens(k, tokens) * per_token for k in (FULL, SLIDING) if self.count(k)}

    def linear_state_values(self) -> int:
        """Values of every linear-attention layer's states together (the same at every context length)."""
        return self.count(LINEAR) * self.linear_state

    def kv_bytes(self, tokens: int, bits_per_value: float) -> dict[str, float]:
        """Analytical KV bytes per attention layer type at ``bits_per_value``, and their ``total``."""
        out = {k: n * bits_per_value / 8 for k, n in self.kv_values(tokens).items()}
        return {**out, "total": sum(out.values())}

    def check_context(self, tokens: int, model_name: str) -> None:
        """Raise if a sliding window is longer than a ``tokens`` context (its sliding layers would be full ones)."""
        if self.window is not None and self.window > tokens:
            raise UnsupportedLayout(
                f"{model_name}'s sliding window ({self.window} tokens) is longer than a {tokens}-token context, so its "
                f"sliding layers would act as full attention: use contexts of at least {self.window} tokens"
            )


def qwen3_5_35b_a3b_config():
    """The text architecture of ``Qwen/Qwen3.5-35B-A3B``, the seeds' model, without its weights: transformers'
    ``Qwen3_5MoeTextConfig`` defaults, which its docstring gives as that checkpoint's (40 layers, every 4th full
    attention with 2 KV heads of 256, the others Gated DeltaNet), with its 262,144-token context."""
    from transformers import AutoConfig  # heavy: transformers, for this one architecture's numbers

    return AutoConfig.for_model("qwen3_5_moe_text", max_position_embeddings=262144)
