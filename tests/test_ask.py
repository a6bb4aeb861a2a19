"""Your model, your document: cache_for in generate() on every layer type, ask and its CLI, the README's examples
run verbatim, and ask's rows equal to the battery's on the same question."""

import re

import pytest
import torch
from conftest import HYBRID_SPECS

from niah.__main__ import main
from niah.ask import Needle, ask, ask_ids
from niah.config import ROOT, load_config
from niah.data.haystack import haystack_text
from niah.kv import cache_for
from niah.kv.cache import GenerateCache
from niah.models import load_model

# full-attention (Llama, Qwen3), sliding-window (Gemma 3) and linear-attention layers (Qwen3.5-MoE)
SPECS = {"llama": load_config("smoke").model, **HYBRID_SPECS}
SPECS["qwen3"] = {**SPECS["llama"], "architecture": "qwen3"}


@pytest.fixture(scope="module", params=sorted(SPECS))
def lm(request):
    return load_model(SPECS[request.param])


def _example(name: str) -> str:
    """The README's code block after ``<!-- example: name -->``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S).group(1)


def _first_token_logits(lm, method: str, ids: list[int]) -> tuple[torch.Tensor, GenerateCache]:
    cache = cache_for(lm.model, method)
    out = lm.model.generate(
        torch.tensor([ids]), cache=cache, max_new_tokens=2, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.logits[0][0], cache


def test_generate_reads_the_prompt_raw_under_engine_and_stored_under_strict(lm):
    """Engine: the prompt's first token is the plain model's (its own keys raw); strict: it reads its stored form."""
    ids = lm.tokenizer.encode(haystack_text("pydoc")[:300])
    with torch.no_grad():
        plain = lm.model(torch.tensor([ids])).logits[0, -1]
    engine, cache = _first_token_logits(lm, "q4_0+all_layers@engine", ids)
    strict, _ = _first_token_logits(lm, "q4_0+all_layers", ids)
    assert engine == pytest.approx(plain, abs=1e-4)
    assert (strict - plain).abs().max() > 1e-3
    assert all(layer.raw_until == len(ids) for layer in cache.layers if hasattr(layer, "raw_until"))  # prompt ended
    stored = cache.nbytes()
    assert stored["total"] == stored["full_attention"] + stored["sliding_attention"] > 0
    assert (stored["linear_state"] > 0) == (lm.model.config.model_type == "qwen3_5_moe_text")


def test_generate_refuses_a_prompt_longer_than_the_engine_chunk(lm):
    with pytest.raises(ValueError, match="longer than the engine read mode's chunk"):
        lm.model.generate(
            torch.tensor([[65] * 40]), cache=cache_for(lm.model, "q8_0@engine", engine_chunk=32), max_new_tokens=2
        )


def test_the_readme_examples_run_verbatim(lm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_document.txt").write_text(haystack_text("pydoc")[:1200], encoding="utf-8")
    scope = {"model": lm.model, "tokenizer": lm.tokenizer}
    exec(_example("generate"), scope)
    exec(_example("ask"), scope)
    table, needle = scope["table"], scope["needle"]
    assert list(table.index) == ["fp16", "q4_0", "turboquant_3bit_nc+centred+scaled"]
    assert table.loc["fp16", "kl_first_token"] == 0 and table.loc["q4_0", "kv_bytes"] < table.loc["fp16", "kv_bytes"]
    assert set(needle["score"]) <= {0.0, 1.0} and needle.attrs["reference_answer"] == " 7731"


@pytest.mark.slow
def test_the_readme_examples_run_verbatim_on_gemma(tmp_path, monkeypatch):
    lm = load_model(load_config("cpu").model)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_document.txt").write_text(haystack_text("pydoc")[:6000], encoding="utf-8")
    scope = {"model": lm.model, "tokenizer": lm.tokenizer}
    exec(_example("generate"), scope)
    exec(_example("ask"), scope)
    assert scope["needle"].loc["fp16", "score"] == 1.0  # Gemma-3-270M finds a needle in 1.5K tokens of pydoc
    assert scope["cache"].nbytes()["sliding_attention"] > 0


def test_ask_refuses_an_empty_context_an_unknown_method_a_static_one_and_a_too_long_prompt(tiny):
    with pytest.raises(ValueError, match="the context is empty"):
        ask(tiny.model, tiny.tokenizer, " \n", "q?")
    with pytest.raises(ValueError, match="unknown KV method 'q9'"):
        ask(tiny.model, tiny.tokenizer, "Some text.", "q?", ["q9"])
    with pytest.raises(ValueError, match=r"\+static key statistics are calibrated per model"):
        ask(tiny.model, tiny.tokenizer, "Some text.", "q?", ["q4_0+centred+static"])
    with pytest.raises(ValueError, match="exceeds the model's limit of 2048 tokens: shorten the context"):
        ask(tiny.model, tiny.tokenizer, "Some text. " * 300, "q?")
    with pytest.raises(ValueError, match="needle depth must be in"):
        ask(tiny.model, tiny.tokenizer, "Some text.", needle=Needle("a", "1", depth=2.0))


def test_the_cli_prints_the_table_and_bad_input_in_one_line(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text. The sky is blue. Water is wet.", encoding="utf-8")
    base = ["ask", "--config", "smoke", "--question", "What colour is the sky?", "--max-new-tokens", "4"]
    assert main([*base, "--methods", "fp16", "q4_0", "--context-file", str(doc)]) == 0
    out = capsys.readouterr().out
    assert "fp16's answer" in out and re.search(r"^q4_0 ", out, re.M)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "long.txt").write_text("Some text. " * 300)
    for args, message in [
        (["--context-file", str(tmp_path / "empty.txt")], "the context is empty"),
        (["--methods", "q9", "--context-file", str(doc)], "unknown KV method 'q9'"),
        (["--context-file", str(tmp_path / "long.txt")], "exceeds the model's limit"),
    ]:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_ask_gives_the_battery_rows_answer_log_prob_and_bytes(smoke_with, tiny, tmp_path):
    from niah.experiments.battery import question_prompts, run_battery
    from niah.results import read_rows

    methods = ["fp16", "q4_0", "q8_0@engine"]
    cfg = smoke_with("battery", lengths=[512], contexts=1, needles=2, methods=methods)
    rows = read_rows(run_battery(cfg, tiny, tmp_path / "b.jsonl", progress=False))
    compared = 0
    for ids, q in question_prompts(cfg, tiny):
        table = ask_ids(
            tiny.model, tiny.tokenizer, ids, list(q.question_ids), methods, list(q.answer_ids), [q.value],
            max_new_tokens=cfg.niah.max_new_tokens, engine_chunk=cfg.niah.engine_chunk,
            prefill_chunk=cfg.niah.prefill_chunk,
        )  # fmt: skip
        for r in (r for r in rows if r["needle_key"] == q.key):
            got = table.loc[r["method"]]
            assert got["answer"] == r["generated"] and got["kv_bytes"] == r["kv_bytes"]
            assert got["answer_logprob"] == pytest.approx(r["answer_logprob"], abs=1e-3)
            compared += 1
    assert compared == len(rows) == 2 * len(methods)
