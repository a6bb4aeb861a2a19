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
    return load_model(smoke_cfg["model"])
