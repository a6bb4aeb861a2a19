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


@pytest.fixture
def killed_after(monkeypatch):
    """``killed_after(n)``: the results table dies (KeyboardInterrupt) on its (n+1)-th append; ``.revive()`` undoes it."""
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
    from niah.config import validate

    def make(section, **settings):
        raw = {k: v for k, v in smoke_cfg.items() if k != "hash"}
        raw[section] = {**smoke_cfg[section], **settings}
        return validate(raw)

    return make
