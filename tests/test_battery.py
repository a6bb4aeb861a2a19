"""The needle battery: contexts built as promised, one row per (question, method), paired statistics, resume."""

import random

import pandas as pd
import pytest

from niah.data.haystack import haystack_text, tokenize_haystack
from niah.data.placement import DEPTH_RULES, build_context, centred_depths, single_prompts, spread_depths
from niah.experiments.battery import run_battery
from niah.kv.layout import UnsupportedLayout
from niah.report.stats import paired_table
from niah.results import read_rows
from niah.schema import ConfigError


def _frame(path):
    return pd.DataFrame(read_rows(path))


def test_a_nested_context_holds_every_lengths_needles_inside_its_prefix(tiny):
    hay = tokenize_haystack(haystack_text("pydoc"), tiny.tokenizer, 5000)
    lengths = [512, 1024, 2048]
    ids, questions = build_context(tiny.tokenizer, hay, lengths, 3, random.Random(0), context=3)
    assert len(ids) == 2048 and len(questions) == 9
    assert len({q.key for q in questions}) == 9
    for q in questions:
        needle = tiny.tokenizer.encode(
            f" One of the special magic numbers for {q.key} is: {q.value}.", add_special_tokens=False
        )
        assert ids[q.position : q.position + len(needle)] == needle
        assert q.position + len(needle) <= q.length, "a needle must lie wholly inside its length's prefix"
        assert not any(q.position < b < q.position + len(needle) for b in lengths), "no prefix ends inside a needle"
        assert q.context == 3
    for L in lengths:
        depths = [q.depth for q in questions if q.length == L]
        assert depths == pytest.approx([0, 0.5, 1])
        positions = [q.position for q in questions if q.length == L]
        assert (
            positions == sorted(positions) and positions[-1] >= L // 2
        )  # the deepest at the last sentence start that still fits (byte tokens: long sentences)


def _battery_cfg(smoke_with, **settings):
    settings = {
        "lengths": [512, 1024],
        "contexts": 2,
        "needles": 2,
        "methods": ["fp16", "q8_0", "turbo3"],
        "mode": "multi_key",
        **settings,
    }
    return smoke_with("battery", **settings)


def test_every_question_gets_a_row_per_method_and_a_killed_run_resumes(tmp_path, smoke_with, tiny, killed_after):
    cfg = _battery_cfg(smoke_with)
    path = tmp_path / "battery.jsonl"
    kill = killed_after(7)
    with pytest.raises(KeyboardInterrupt):
        run_battery(cfg, tiny, path, progress=False)
    assert len(_frame(path)) == 7
    kill.revive()
    run_battery(cfg, tiny, path, progress=False)
    df = _frame(path)
    assert len(df) == 2 * 2 * 2 * 3 and (df["status"] == "ok").all()
    assert not df.duplicated(["length", "depth", "trial", "method"]).any()
    assert (df[df["method"] == "fp16"]["kl_vs_ref"] == 0).all() and (
        df[df["method"] == "turbo3"]["kl_vs_ref"] > 0
    ).all()
    table = paired_table(df).set_index(["method", "length"])
    assert (table["n"] == 4).all()
    assert table.loc[("fp16", 1024), "p"] == 1.0 and table.loc[("fp16", 1024), "logprob_diff"] == 0


def test_separate_contexts_hold_only_their_own_lengths_needles(tmp_path, smoke_with, tiny):
    cfg = _battery_cfg(smoke_with, nested=False, methods=["fp16"])
    df = _frame(run_battery(cfg, tiny, tmp_path / "b.jsonl", progress=False))
    assert len(df) == 2 * 2 * 2
    assert (df.groupby(["length", "context"]).size() == 2).all()
    nested = _frame(run_battery(_battery_cfg(smoke_with, methods=["fp16"]), tiny, tmp_path / "n.jsonl", progress=False))
    assert set(df["needle_key"]) != set(nested["needle_key"])  # other contexts, other keys


@pytest.mark.parametrize(
    "mode", ["multi_key", "single"]
)  # single: a shared prefix cropped back, or restarted (linear layers)
def test_a_hybrid_model_runs_the_battery_and_reports_bytes_per_layer_type(tmp_path, smoke_with, hybrid, mode):
    cfg = _battery_cfg(smoke_with, methods=["fp16", "q4_0"], mode=mode)
    df = _frame(run_battery(cfg, hybrid, tmp_path / "h.jsonl", progress=False))
    assert (df["status"] == "ok").all() and len(df) == 16
    sliding = df["kv_bytes_sliding_attention"]
    if hybrid.model.config.model_type == "gemma3_text":
        assert (sliding > 0).all() and (df["linear_state_bytes"] == 0).all()
    else:
        assert (sliding == 0).all() and (df["linear_state_bytes"] > 0).all()
    assert (df["kv_bytes"] == df["kv_bytes_full_attention"] + sliding).all()


def test_single_needle_prompts_hold_one_needle_and_match_a_fresh_prefill(tmp_path, smoke_with, tiny):
    cfg = _battery_cfg(smoke_with, mode="single", needles=3, methods=["fp16", "q4_0"])
    path = tmp_path / "single.jsonl"
    df = _frame(run_battery(cfg, tiny, path, progress=False))
    assert len(df) == 2 * 2 * 3 * 2 and (df["status"] == "ok").all()
    assert not df.duplicated(["length", "depth", "trial", "method"]).any()
    assert sorted(df["depth"].unique()) == pytest.approx([0, 0.5, 1])
    assert (df[df["method"] == "q4_0"]["kl_vs_ref"] > 0).all()
    # a prompt holds only its own needle, and the shared-prefix reuse reads what a fresh prefill of that prompt reads
    from niah.experiments.protocol import ask, context_states, prefill
    from niah.kv.cache import PackedCache
    from niah.kv.registry import get_method
    from niah.kv.spec import CacheSpec

    hay = tokenize_haystack(haystack_text("pydoc"), tiny.tokenizer, 1024 * 2)
    s = cfg.battery
    depths, rng = DEPTH_RULES[s.depths](s.needles), random.Random(f"{cfg.seed}/battery")
    prompts = single_prompts(tiny.tokenizer, hay, s.contexts, s.lengths, depths, rng, "number", "completion")
    ids, q = prompts[1][-1]
    assert tiny.tokenizer.decode(ids).count("special magic number") == 2  # the intro's and the needle's
    fresh = PackedCache.from_states(context_states(prefill(tiny.model, ids, chunk=100)), CacheSpec(get_method("fp16")))
    ans = ask(tiny.model, tiny.tokenizer, fresh, list(q.question_ids), list(q.answer_ids), 4)
    got = df[(df["method"] == "fp16") & (df["trial"] == q.trial) & (df["length"] == q.length)]["answer_logprob"]
    assert got.item() == pytest.approx(ans.answer_logprob, abs=1e-3)


def test_centred_depths_keep_every_needle_off_both_ends(tmp_path, smoke_with, tiny):
    assert centred_depths(5) == [0.1, 0.3, 0.5, 0.7, 0.9] and spread_depths(3) == [0, 0.5, 1]
    cfg = _battery_cfg(smoke_with, mode="single", needles=2, depths="centred", methods=["fp16"], contexts=1)
    df = _frame(run_battery(cfg, tiny, tmp_path / "centred.jsonl", progress=False))
    assert sorted(df["depth"].unique()) == pytest.approx([0.25, 0.75]) and len(df) == 2 * 2
    assert df["needle_position"].between(0.1, 0.9).all()  # sentence starts move a needle back a little


def test_bad_battery_settings_and_windows_longer_than_the_context_say_so(tmp_path, smoke_with, hybrid):
    with pytest.raises(ValueError, match="unknown battery setting"):
        _battery_cfg(smoke_with, needle=3).battery
    with pytest.raises(ValueError, match="unknown battery mode"):
        _battery_cfg(smoke_with, mode="many").battery
    with pytest.raises(ValueError, match="unknown battery depths 'middle'"):
        _battery_cfg(smoke_with, depths="middle").battery
    with pytest.raises(ValueError, match="do not fit"):
        build_context(
            hybrid.tokenizer,
            tokenize_haystack(haystack_text("pydoc"), hybrid.tokenizer, 3000),
            [256],
            6,
            random.Random(0),
        )
    if hybrid.model.config.model_type == "gemma3_text":
        with pytest.raises(UnsupportedLayout, match="sliding window"):
            run_battery(_battery_cfg(smoke_with, lengths=[8, 512]), hybrid, tmp_path / "x.jsonl", progress=False)


def test_a_method_asked_at_some_lengths_only_gets_rows_there_and_keeps_the_hashes(
    smoke_with, smoke_cfg, tiny, tmp_path
):
    """``battery.method_lengths`` (one declaration in niah.schema): the method's rows exist at its lengths only, the
    reference and the other methods answer everywhere, the table's settings hash is unchanged (the setting only
    chooses rows), a dry run shrinks its lengths, and a length outside the battery is refused at load."""
    from niah.dryrun import dry_config
    from niah.rundir import settings_hash

    cfg = smoke_with("battery", methods=["fp16", "q8_0", "q4_0"], method_lengths={"q4_0": [1024]}, needles=1)
    rows = read_rows(run_battery(cfg, tiny, tmp_path / "b.jsonl", progress=False))
    asked = {(r["method"], r["length"]) for r in rows}
    assert asked == {("fp16", 512), ("fp16", 1024), ("q8_0", 512), ("q8_0", 1024), ("q4_0", 1024)}
    assert settings_hash(cfg, "needles") == settings_hash(
        smoke_with("battery", methods=["fp16", "q8_0", "q4_0"], needles=1), "needles"
    )
    assert dry_config(cfg)[0]["battery"]["method_lengths"] == {"q4_0": [256]}  # 1024 // 16, at the needle floor
    with pytest.raises(ConfigError, match="method_lengths"):
        smoke_with("battery", method_lengths={"q4_0": [2048]})
