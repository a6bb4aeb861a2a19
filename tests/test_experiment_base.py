"""The experiment base: provenance on every row, missing rows only, too_long/oom rows that count as done."""

from types import SimpleNamespace

import pytest

from niah.config import ConfigError
from niah.experiments.base import Collect, Experiment, RowSink, check_answer_room, provenance, too_long_reason
from niah.results import read_rows


def test_rows_carry_provenance_and_a_reopened_table_knows_what_is_done(tmp_path, smoke_cfg):
    path = tmp_path / "sweep.jsonl"
    exp = Experiment(smoke_cfg, "sweep", "tiny", path, progress=False)
    assert exp.missing(["fp16", "q8_0"], length=256) == ["fp16", "q8_0"]
    exp.start(2, "test")
    exp.write([{**exp.row(method="fp16", length=256), "status": "ok", "kv_bytes": 1}])
    exp.fail([exp.row(method="q8_0", length=256)], "oom", RuntimeError("x" * 1000))
    assert exp.close() == path
    rows = read_rows(path)
    assert [r["status"] for r in rows] == ["ok", "oom"] and len(rows[1]["reason"]) == 300
    assert {k: rows[0][k] for k in ("config", "config_hash", "model", "seed")} == {
        "config": smoke_cfg.name,
        "config_hash": smoke_cfg.hash,
        "model": "tiny",
        "seed": smoke_cfg.seed,
    }
    assert set(provenance(smoke_cfg, "tiny")) <= set(rows[0])
    again = Experiment(smoke_cfg, "sweep", "tiny", path, progress=False)
    assert again.missing(["fp16", "q8_0", "q4_0"], length=256) == ["q4_0"]  # an oom row is a result, not a gap


def test_too_long_names_the_limit_and_the_fix_only_when_the_model_can_be_extended(smoke_cfg):
    native = SimpleNamespace(max_context=1024, native_context=1024)
    extended = SimpleNamespace(max_context=2048, native_context=1024)
    assert smoke_cfg.niah.max_new_tokens == 8
    assert too_long_reason(smoke_cfg, native, 1016, 3) is None  # 1016 + room for 8 answer tokens
    reason = too_long_reason(smoke_cfg, native, 1020, 5)  # the expected answer itself does not fit
    assert "limit of 1024 tokens" in reason and "rope_scaling" in reason
    assert "rope_scaling" not in too_long_reason(smoke_cfg, extended, 4096)


def test_a_max_new_tokens_without_room_is_refused_with_advice_from_the_longest_prompt_that_fits(smoke_cfg):
    native = SimpleNamespace(max_context=1024, native_context=1024)
    check_answer_room(smoke_cfg, native, [(1000, 3), (1016, 3), (2000, 5)])  # 2000 is too long whatever the room
    with pytest.raises(ConfigError, match="niah.max_new_tokens = 8 .*longest prompt .*1020 tokens.*to 4 or less"):
        check_answer_room(smoke_cfg, native, [(1000, 3), (1020, 3), (2000, 5)])


def test_the_table_and_a_workers_collection_are_both_row_sinks(tmp_path, smoke_cfg):
    exp, collect = Experiment(smoke_cfg, "sweep", "tiny", tmp_path / "s.jsonl", progress=False), Collect(smoke_cfg)
    assert isinstance(exp, RowSink) and isinstance(collect, RowSink)
    collect.fail([collect.row(method="q8_0", length=256)], "oom", "x")
    assert collect.rows == [{"method": "q8_0", "length": 256, "status": "oom", "reason": "x"}]  # no provenance
