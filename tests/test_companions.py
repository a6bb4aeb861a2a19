"""Companion configs (issue 42): another architecture's battery and KV perplexity asked inside a config's chain, each
in its own run folder, checked at load and dry-run with the config."""

import pytest
import yaml

from niah.config import ROOT, ConfigError, companion_configs, load_config
from niah.dryrun import write_dry_config
from niah.notebook import companions
from niah.rundir import RunDir


def _write(path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return str(path)


def _companion(tmp_path, **extra) -> str:
    """A smoke-sized companion: the smoke model, one battery length, two methods, a short KV perplexity."""
    raw = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    raw |= {"name": "buddy", "battery": {**raw["battery"], "lengths": [512], "methods": ["fp16", "q4_0"]}}
    raw["kv_perplexity"] = {"methods": ["fp16", "q4_0"], "breakdown": ["keys", "values"], "windows": 1,
                            "context": 64, "continuation": 16}  # fmt: skip
    return _write(tmp_path / "buddy.yaml", raw | extra)


def test_a_companion_that_names_no_config_is_refused_at_load(smoke_with):
    with pytest.raises(ConfigError, match=r"no config named 'nonesuch': choose one of .*smoke"):
        smoke_with("", companions=["nonesuch"])
    with pytest.raises(ConfigError, match="companions lists config names or paths; got 3"):
        smoke_with("", companions=[3])


def test_a_companion_with_companions_of_its_own_is_refused(tmp_path, smoke_with):
    cfg = smoke_with("", companions=[_companion(tmp_path, companions=["smoke"])])
    with pytest.raises(ConfigError, match="companion buddy names companions of its own"):
        companion_configs(cfg)


def test_the_dry_run_of_a_config_dry_runs_its_companions(tmp_path):
    cfg = load_config(_write(tmp_path / "host.yaml", {"name": "host", **_shipped("smoke"), "companions": ["quick"]}))
    path, _ = write_dry_config(cfg.source, tmp_path)
    dry = load_config(str(path))
    (other,) = companion_configs(dry)
    assert other.name == "quick-dry" and other.model["source"] == "random"  # the companion's tiny random model
    assert (tmp_path / "quick-dry" / "dry-config.yaml").exists()


def test_the_dry_run_names_what_it_left_out_of_a_companion(tmp_path):
    buddy = _companion(tmp_path, cluster={"address": "auto"})
    host = load_config(_write(tmp_path / "host.yaml", {"name": "host", **_shipped("smoke"), "companions": [buddy]}))
    _, left_out = write_dry_config(host.source, tmp_path)
    assert left_out == ["buddy cluster: (it runs in one process)"]


def test_a_companions_battery_and_perplexity_land_in_its_own_run_folder(tmp_path, smoke_with):
    cfg = smoke_with("", companions=[_companion(tmp_path)])
    run = RunDir(cfg, tmp_path / "runs" / "smoke")
    (out,) = companions(cfg, run)
    folder = RunDir(load_config(str(tmp_path / "buddy.yaml")), tmp_path / "runs" / "buddy")
    needles, ppl = folder.rows("needles"), folder.rows("kv_perplexity")
    assert out["config"] == "buddy" and len(needles) == 2 * 4 and set(needles["method"]) == {"fp16", "q4_0"}
    paired = out["paired"].set_index("method")
    assert int(paired.loc["q4_0", "n"]) == 4  # the companion's own questions, paired with its own fp16
    assert set(ppl["method"]) >= {"fp16", "q4_0", "q4_0+keys", "q4_0+values"} and len(out["perplexity"])
    assert (folder.path / "environment.json").exists() and not (tmp_path / "runs" / "smoke").exists()
    (again,) = companions(cfg, run)  # resumable: a rerun asks nothing again
    assert len(folder.rows("needles")) == len(needles)


def _shipped(name: str) -> dict:
    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    return {k: v for k, v in raw.items() if k != "name"}
