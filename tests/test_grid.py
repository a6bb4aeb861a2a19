import copy

import pytest

from niah.config import validate
from niah.experiments.grid import cells, run_grid
from niah.results import read_rows
from niah.rundir import NEEDLE_KEY as KEY


def _cfg(smoke_cfg, **niah):
    raw = copy.deepcopy(smoke_cfg.raw)
    raw["niah"] = {**smoke_cfg.raw["niah"], **niah}
    return validate(raw)


def test_grid_writes_one_row_per_cell_and_method(smoke_cfg, tiny, tmp_path):
    cfg = _cfg(smoke_cfg, lengths=[300, 400], depths=[0.0, 1.0])
    rows = read_rows(run_grid(cfg, tiny, tmp_path / "r.jsonl", progress=False))
    assert len(rows) == len(cells(cfg)) * len(cfg.niah.methods)
    assert {r["status"] for r in rows} == {"ok"}
    ok = rows[0]
    for field in (
        "config_hash",
        "git_commit",
        "versions",
        "seed",
        "generated",
        "answer_logprob",
        "prefill_s",
        "decode_s_per_token",
        "kv_bytes",
    ):
        assert field in ok
    ref = [r for r in rows if r["method"] == "fp16"]
    assert all(r["kl_vs_ref"] == 0 and r["top1_vs_ref"] == 1 for r in ref)


def test_shared_prefix_gives_the_same_answers_as_separate_prefills(smoke_cfg, tiny, tmp_path):
    cfg = _cfg(smoke_cfg, lengths=[400], depths=[0.5, 1.0], methods=["fp16"])
    shared = read_rows(run_grid(cfg, tiny, tmp_path / "a.jsonl", progress=False))
    alone = []
    for d in (0.5, 1.0):
        alone += read_rows(
            run_grid(
                _cfg(smoke_cfg, lengths=[400], depths=[d], methods=["fp16"]),
                tiny,
                tmp_path / f"b{d}.jsonl",
                progress=False,
            )
        )
    assert any(r["shared_prefix_tokens"] > 0 for r in shared)
    by = {(r["depth"]): r for r in alone}
    for r in shared:
        assert r["answer_logprob"] == pytest.approx(by[r["depth"]]["answer_logprob"], abs=1e-4)
        assert r["generated"] == by[r["depth"]]["generated"]


def test_a_killed_grid_resumes_without_losing_or_duplicating_rows(smoke_cfg, tiny, tmp_path, killed_after):
    cfg = _cfg(smoke_cfg, lengths=[300], depths=[0.0, 0.5, 1.0])
    path = tmp_path / "r.jsonl"
    kill = killed_after(3)
    with pytest.raises(KeyboardInterrupt):
        run_grid(cfg, tiny, path, progress=False)
    kill.revive()
    assert len(read_rows(path)) == 3
    rows = read_rows(run_grid(cfg, tiny, path, progress=False))
    keys = [tuple(r[k] for k in KEY) for r in rows]
    assert len(keys) == len(set(keys)) == len(cells(cfg)) * len(cfg.niah.methods)


def test_too_long_cells_are_recorded_and_the_grid_goes_on(smoke_cfg, tiny, tmp_path):
    cfg = _cfg(smoke_cfg, lengths=[300, 4000], depths=[0.5])
    rows = read_rows(run_grid(cfg, tiny, tmp_path / "r.jsonl", progress=False))
    status = {(r["length"], r["method"]): r for r in rows}
    assert status[(300, "fp16")]["status"] == "ok"
    long = status[(4000, "fp16")]
    assert long["status"] == "too_long" and "limit of 2048" in long["reason"] and "rope_scaling" in long["reason"]
