"""Dry runs: every GPU config's chain on the CPU with a tiny model of its architecture, and make gpu-check's script."""

import json
import subprocess

import pandas as pd
import pytest
import torch

from niah.config import ROOT, load_config
from niah.dryrun import SCALE, dry_config, pattern_period, write_dry_config
from niah.models import load_model
from niah.schema import FITS_A_NEEDLE, fitting_lengths, sweep_lengths

GPU_CONFIGS = ["h200", "a100-80g", "qwen3.5-35b-a3b-random"]


def test_the_layer_pattern_period_is_the_shortest_repeat():
    assert pattern_period(["full_attention"] * 5) == 1
    assert pattern_period(["linear_attention"] * 3 + ["full_attention"]) == 4
    assert (
        pattern_period((["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2) == 6
    )  # Gemma 3


@pytest.mark.parametrize(
    "config, arch, heads, layers",
    [
        ("h200", "qwen3_5_moe_text", (16, 2, 256), ["linear_attention"] * 3 + ["full_attention"]),
        ("a100-80g", "llama", (32, 8, 128), None),
        ("qwen3.5-35b-a3b-random", "qwen3_5_moe_text", (16, 2, 256), ["linear_attention"] * 3 + ["full_attention"]),
    ],
)
def test_a_dry_config_keeps_the_architecture_and_every_method_and_shrinks_the_rest(
    tmp_path, config, arch, heads, layers
):
    real = load_config(config)
    path, left_out = write_dry_config(config, tmp_path)
    dry = load_config(str(path))  # the rewritten file passes the same checks
    assert path == tmp_path / f"{real.name}-dry" / "dry-config.yaml" and dry.name == f"{real.name}-dry"
    assert dry.device == "cpu" and dry.model["source"] == "random" and dry.model["architecture"] == arch
    assert dry.model["dtype"] == real.model.get("dtype", "float32")
    assert dry.niah.methods == real.niah.methods
    assert dry.niah.lengths == [n // SCALE for n in real.niah.lengths]
    for name in ("battery", "sweep", "kv_perplexity"):
        assert getattr(dry, name).present == getattr(real, name).present  # every section it asks, no other
    if real.sweep.present:
        assert dry.sweep.methods == real.sweep.methods
    lm = load_model(dry.model)
    c = lm.model.config
    assert (
        c.model_type == arch and (c.num_attention_heads, c.num_key_value_heads, lm.head_dim) == heads
    )  # query, KV heads, head_dim
    if layers:
        assert c.layer_types == layers * 2  # the first two periods of the real pattern
    assert sum(p.numel() for p in lm.model.parameters()) < 30e6
    assert left_out == []


@pytest.mark.parametrize("config", sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_config_dry_runs_to_its_needle_questions(tmp_path, config):
    """Each shipped config's dry run loads, and its needle questions (notebook 03's battery, notebooks 01-02's
    weights x KV cells) fit its shortened lengths, and its weight groups its narrowed layers: the smoke config's
    needles did not fit (512 / 16 leaves 32 tokens), nor could quick's 9 heads share a hidden size with group 64."""
    from niah.experiments.battery import battery_contexts
    from niah.weightquant.needle import needle_battery

    dry = load_config(str(write_dry_config(config, tmp_path)[0]))
    lm = load_model(dry.model)
    batteries = [needle_battery(dry)] + ([dry.battery] if dry.battery.present else [])
    for battery in batteries:
        assert battery_contexts(dry, lm, battery)  # raises where a needle does not fit
    assert min(dry.niah.lengths) >= FITS_A_NEEDLE
    linears = [m for m in lm.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.in_features % dry.weightquant.group == 0 for m in linears)  # notebook 01's groups (quick's did not)


def test_the_dry_run_shortens_needle_lengths_to_a_floor_that_fits_a_needle_and_keeps_each_once():
    assert fitting_lengths([4096, 8192, 16384]) == [256, 512, 1024]
    assert fitting_lengths([512, 1024, 8192]) == [FITS_A_NEEDLE, 512]
    assert sweep_lengths([1, 64, 256, 512]) == [1, 4, 16, FITS_A_NEEDLE]  # the longest step holds the probe


def test_a_dry_run_leaves_out_what_a_random_model_cannot_do_and_says_so():
    cpu = load_config("cpu")
    dry, left_out = dry_config(cpu.updated("llamacpp", contexts=1).updated("cluster", workers=2))
    assert dry["llamacpp"] == {} and dry["cluster"] == {}
    assert [w.split(":")[0] for w in left_out] == ["llamacpp", "cluster"]


def test_figures_of_a_new_or_dry_config_are_ignored_by_git():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "figures/h200-dry/heatmap.png"], cwd=ROOT).returncode == 0
    tracked = subprocess.run(["git", "check-ignore", "-q", "figures/cpu/heatmap.png"], cwd=ROOT).returncode == 0
    assert ignored and not tracked


def test_gpu_check_refuses_a_machine_without_a_gpu_and_its_dry_run_fills_the_table(tmp_path):
    import torch

    from niah.gpucheck import check_config, gpu_check
    from niah.models import ModelUnavailable

    if not torch.cuda.is_available():
        with pytest.raises(ModelUnavailable, match="make gpu-check DRY_RUN=1"):
            check_config(dry_run=False)
    report = gpu_check(dry_run=True, run_root=tmp_path).read_text()
    assert "dry run on the CPU" in report and "memory sampling: psutil rss" in report and "rows not ok: 0" in report
    rows = pd.read_json(tmp_path / "gpu-check-dry" / "sweep_results.jsonl", lines=True)
    assert sorted(zip(rows["method"], rows["length"])) == sorted(
        (m, L) for m in ["fp16", "q8_0", "turboquant_k8v4"] for L in [4096 // SCALE, 16384 // SCALE]
    )
    assert (rows["kv_bytes_full_attention"] > 0).all() and (rows["linear_state_bytes"] > 0).all()
    assert json.loads((tmp_path / "gpu-check-dry" / "environment.json").read_text())["cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["h200", "a100-80g"])  # qwen3.5-35b-a3b-random: h200's architecture and sections
def test_the_dry_run_of_a_gpu_config_executes_its_whole_chain(tmp_path, config):
    from niah.report.chain import chain, reproduce

    path, _ = write_dry_config(config, tmp_path / "runs")
    times = reproduce(str(path), run_root=tmp_path / "runs", figures_root=tmp_path / "figs")
    out = tmp_path / "runs" / f"{config}-dry"
    assert set(times) >= {nb.name for nb in chain()} | {"total"}
    assert (out / "summary.md").exists() and (out / "timing.json").exists()
    assert list((tmp_path / "figs" / f"{config}-dry").glob("*.png"))
    print(f"dry run of {config}: {times['total']:.0f} s")


def test_the_readme_counts_of_qwen3_5_weights_come_from_the_architecture():
    """README: 34.7B weights (64.6 GiB in bf16), 32.2B of the decoder's 33.6B (96%) outside nn.Linear."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from niah.weightquant.salience import uncoded_weights

    with init_empty_weights():
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_moe_text"))
    total = sum(p.numel() for p in m.parameters())
    decoder = sum(p.numel() for p in m.model.layers.parameters())
    uncoded = sum(uncoded_weights(m).values())
    assert (round(total / 1e9, 1), round(2 * total / 2**30, 1)) == (34.7, 64.6)
    assert (round(uncoded / 1e9, 1), round(decoder / 1e9, 1), round(uncoded / decoder, 2)) == (32.2, 33.6, 0.96)
