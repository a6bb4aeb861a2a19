"""llama.cpp side by side: settings, the agreement and speed tables, the ledger's llama.cpp clauses, and (slow, with
the ``[llamacpp]`` extra installed, as CI has it) llama.cpp itself on the Gemma GGUF against this repo's answers."""

import copy
from dataclasses import replace

import pandas as pd
import pytest

from niah.experiments.llamacpp import cross_check, run_llamacpp, variants
from niah.report.claims import Evidence, _llamacpp_note
from niah.report.tables import agreement_table, speed_table
from niah.schema import Battery


def test_settings_name_bad_cache_types_and_need_the_f16_reference(smoke_with):
    with pytest.raises(ValueError, match="unknown llama.cpp cache type"):
        smoke_with("llamacpp", kv=["f16", "q5_1"]).llamacpp
    with pytest.raises(ValueError, match="must include f16"):
        smoke_with("llamacpp", kv=["q8_0"]).llamacpp
    with pytest.raises(ValueError, match="unknown llamacpp setting"):
        smoke_with("llamacpp", threads=3).llamacpp
    s = smoke_with("llamacpp", kv=["f16", "q8_0"]).llamacpp
    assert variants(s) == [("lcpp_f16", "f16", False), ("lcpp_q8_0", "q8_0", True), ("lcpp_q8_0_norot", "q8_0", False)]


def _rows(methods, scores, logprob, kl=0.0, **extra):
    return [
        {
            "status": "ok",
            "method": m,
            "prompt_style": "completion",
            "length": 1024,
            "depth": d,
            "trial": t,
            "score": s,
            "generated": " 123" if s else " 9",
            "answer_logprob": logprob,
            "kl_vs_ref": 0.0 if m in ("fp16", "lcpp_f16") else kl,
            "top1_vs_ref": 1.0,
            **extra,
        }
        for m in methods
        for t, (d, s) in enumerate(zip([0.0, 0.5, 1.0, 0.25], scores))
    ]


def _lcpp_frame():
    f16 = _rows(
        ["lcpp_f16"], [1, 1, 1, 1], -1.0, prefill_tokens_per_s=200.0, decode_s_per_token=0.04, state_bytes=2**21
    )
    q8 = _rows(
        ["lcpp_q8_0"],
        [1, 1, 0, 1],
        -1.5,
        kl=0.01,
        prefill_tokens_per_s=100.0,
        decode_s_per_token=0.05,
        state_bytes=2**20,
    )
    return pd.DataFrame(f16 + q8)


def test_agreement_pairs_each_llamacpp_cache_with_this_repos_emulation_on_the_same_questions():
    ours = pd.DataFrame(_rows(["fp16"], [1, 1, 1, 1], -1.2) + _rows(["q8_0"], [1, 1, 1, 1], -1.25, kl=0.001))
    t = agreement_table(_lcpp_frame(), ours).set_index("llama.cpp")
    assert list(t.index) == ["lcpp_f16", "lcpp_q8_0"] and (t["n"] == 4).all()
    assert t.loc["lcpp_q8_0", "this repo"] == "q8_0"
    assert t.loc["lcpp_q8_0", "accuracy llama.cpp"] == 0.75 and t.loc["lcpp_q8_0", "accuracy this repo"] == 1.0
    assert t.loc["lcpp_q8_0", "scores agree"] == 0.75 and t.loc["lcpp_f16", "same answer text"] == 1.0
    assert t.loc["lcpp_q8_0", "logprob diff"] == pytest.approx(-0.25)
    assert t.loc["lcpp_q8_0", "KL llama.cpp"] == pytest.approx(0.01) and t.loc[
        "lcpp_q8_0", "KL this repo"
    ] == pytest.approx(0.001)
    speed = speed_table(_lcpp_frame()).set_index("method")
    assert (
        speed.loc["lcpp_q8_0", "decode_vs_f16"] == pytest.approx(1.25)
        and speed.loc["lcpp_q8_0", "prefill_vs_f16"] == 0.5
    )
    assert speed.loc["lcpp_f16", "state_mib"] == 2.0


def test_the_ledger_quotes_llamacpp_only_when_it_ran():
    assert _llamacpp_note(Evidence("cpu"), "accuracy") == ""
    ev = Evidence("cpu", llamacpp=_lcpp_frame())
    assert "lcpp_q8_0 0.75 vs f16 1.00" in _llamacpp_note(ev, "accuracy") and "4 questions" in _llamacpp_note(
        ev, "accuracy"
    )
    assert "decode time per token = 1.25" in _llamacpp_note(ev, "decode")
    assert "q8_0 1.0 MiB, f16 2.0 MiB" in _llamacpp_note(ev, "memory")
    assert "KL(f16 || q8_0) = 1.00e-02" in _llamacpp_note(ev, "kl")


def test_the_summary_shows_the_side_by_side_tables_when_llamacpp_ran(tmp_path, smoke_cfg):
    from niah.report.summary import summary_markdown
    from niah.rundir import open_table

    ours = _rows(["fp16"], [1, 1, 1, 1], -1.2, context=0) + _rows(
        ["q8_0"], [1, 1, 1, 1], -1.25, kl=0.001, context=0
    )  # battery rows
    lcpp = _lcpp_frame().to_dict("records")
    for kind, file, rows in (("needles", "niah_results.jsonl", ours), ("llamacpp", "llamacpp_results.jsonl", lcpp)):
        table = open_table(smoke_cfg, kind, tmp_path / file)
        for r in rows:
            table.append(
                {"config": smoke_cfg.name, "model": "m", "git_commit": "c", "time": "t", "bits_per_value": 16, **r}
            )
    text = summary_markdown(smoke_cfg, tmp_path)
    assert "**llama.cpp side by side**" in text and "| lcpp_q8_0 " in text and "decode_vs_f16" in text


def test_without_the_extra_the_section_says_how_to_install_it(monkeypatch, smoke_cfg, capsys):
    import niah.experiments.llamacpp as lc

    monkeypatch.setattr(lc, "installed", lambda: False)
    assert cross_check(smoke_cfg, None, None) is None
    assert "make setup-llamacpp" in capsys.readouterr().out


def test_a_config_without_a_battery_skips_the_cross_check_and_says_why(monkeypatch, smoke_cfg, capsys):
    import niah.experiments.llamacpp as lc

    monkeypatch.setattr(lc, "installed", lambda: True)
    cfg = replace(smoke_cfg, model={**smoke_cfg.model, "source": "package"}, battery=Battery())
    assert cross_check(cfg, None, None) is None
    assert "has no battery: section" in capsys.readouterr().out


def test_run_llamacpp_without_a_battery_refuses_rather_than_ask_default_questions(smoke_cfg):
    with pytest.raises(ValueError, match="has no battery: section"):
        run_llamacpp(replace(smoke_cfg, battery=Battery()), None)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["cpu", "quick"])  # their models: Gemma-3-270M Q4_K_M, SmolLM2-135M Q4_1
def test_llamacpp_f16_answers_like_this_repos_fp16_on_the_same_ids_and_q8_0_runs(tmp_path, which):
    pytest.importorskip("llama_cpp", reason="the [llamacpp] extra is not installed (make setup-llamacpp)")
    from niah.config import load_config, validate
    from niah.experiments.battery import run_battery
    from niah.models import load_model
    from niah.rundir import load_table

    raw = copy.deepcopy(load_config("cpu").raw)
    raw["model"] = load_config(which).model
    raw["battery"] = {
        **raw["battery"],
        "lengths": [1024],
        "contexts": 1,
        "needles": 3,
        "methods": ["fp16", "q8_0"],
        "method_lengths": {},
    }
    raw["llamacpp"] = {"lengths": [1024], "contexts": 1, "kv": ["f16", "q8_0"], "rotation": [True]}
    cfg = validate(raw)
    lm = load_model(cfg.model)
    from niah.experiments.llamacpp import run_llamacpp

    ours = load_table(cfg, "needles", run_battery(cfg, lm, tmp_path / "n.jsonl", progress=False))
    lcpp = load_table(cfg, "llamacpp", run_llamacpp(cfg, lm, tmp_path / "l.jsonl", progress=False))
    assert len(lcpp) == 6 and (lcpp["status"] == "ok").all()
    key = ["length", "depth", "trial"]
    f16 = lcpp[lcpp["method"] == "lcpp_f16"].set_index(key)["generated"].str.strip()
    fp16 = ours[ours["method"] == "fp16"].set_index(key)["generated"].str.strip()
    assert f16.sort_index().tolist() == fp16.sort_index().tolist()
    q8 = lcpp[lcpp["method"] == "lcpp_q8_0"]
    assert (q8["kl_vs_ref"] > 0).all() and (
        q8["state_bytes"] < lcpp[lcpp["method"] == "lcpp_f16"]["state_bytes"].max()
    ).all()
