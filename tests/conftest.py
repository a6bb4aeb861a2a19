import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smoke_cfg():
    from niah.config import load_config

    return load_config("smoke")


@pytest.fixture(scope="session")
def tiny(smoke_cfg):
    """The smoke config's random-weight Llama (2 layers, 2 KV heads, head_dim 32) with the byte tokenizer."""
    import torch

    from niah.models import load_model

    torch.set_num_threads(1)
    return load_model(smoke_cfg.model)


@pytest.fixture
def killed_after(monkeypatch):
    """``killed_after(n)``: the results table dies (KeyboardInterrupt) on its (n+1)-th append; ``.revive()`` undoes
    it."""
    from niah.results import ResultsTable

    real = ResultsTable.append

    class Kill:
        def __init__(self, n):
            left = [n]

            def append(table, row):
                if left[0] == 0:
                    raise KeyboardInterrupt("killed")
                left[0] -= 1
                real(table, row)

            monkeypatch.setattr(ResultsTable, "append", append)

        def revive(self):
            monkeypatch.setattr(ResultsTable, "append", real)

    return Kill


@pytest.fixture
def smoke_with(smoke_cfg):
    """``smoke_with(section, **settings)``: the smoke config with ``settings`` over its ``section``, validated."""

    def make(section, **settings):
        return smoke_cfg.updated(section, **settings)

    return make


# Tiny random hybrids: Gemma 3's sliding-window layers (window 16) and Qwen3.5-MoE's linear-attention layers,
# each with one full-attention layer, the byte tokenizer's vocabulary.
_TINY = {
    "vocab_size": 258,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 0,
}
HYBRID_SPECS = {
    "gemma3": {
        "source": "random",
        "architecture": "gemma3_text",
        "seed": 0,
        "config": {
            **_TINY,
            "intermediate_size": 128,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        },
    },
    "qwen3_5_moe": {
        "source": "random",
        "architecture": "qwen3_5_moe_text",
        "seed": 0,
        "config": {
            **_TINY,
            "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
        },
    },
}


@pytest.fixture(scope="session", params=sorted(HYBRID_SPECS))
def hybrid(request):
    """A tiny random-weight hybrid model (``gemma3``: sliding-window layers; ``qwen3_5_moe``: linear attention)."""
    from niah.models import load_model

    return load_model(HYBRID_SPECS[request.param])
