"""A dry run of any config on the CPU: its whole chain, with a tiny random model of the same architecture.

``python -m niah reproduce --config h200 --dry-run`` rewrites the config (:func:`dry_config`) and runs the chain
on the result, in ``papermill_runs/<name>-dry/``; nothing it writes mixes with the real run's rows.  What stays:
every section, method, figure and ledger row; the model type, its layer-type pattern (the first two periods of
it), its KV heads, query heads per KV head and head_dim, its dtype.  What shrinks: the width of everything else
(hidden size, MLPs, experts, linear-attention heads, a 258-token byte vocabulary), the lengths (divided by
:data:`SCALE`, sliding windows and prompt chunks with them) and the counts (contexts, needles, windows, steps; the
grid's depths to both ends and the middle).
Its answers mean nothing; it finds the typo, the shape and the figure that break before a GPU is paid for.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import yaml

from .config import ROOT, Config, ConfigError, companion_configs, filled, load_config
from .models import _converted_folder
from .schema import SCALE, SECTIONS

# The text architecture of hub models whose config.json this machine may not have (no network); field values from
# each model's config.json on the hub.  Qwen3.5-35B-A3B's text model is transformers' Qwen3_5MoeTextConfig defaults.
KNOWN = {
    "Qwen/Qwen3.5-35B-A3B": ("qwen3_5_moe_text", {}),
    "meta-llama/Llama-3.1-8B-Instruct": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}

# widths set to at most these (only where the architecture has the field); heads and head_dim are kept
NARROW = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
# niah.tokenizer.ByteTokenizer
BYTE_VOCAB = {"vocab_size": 258, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": None}
DROPPED_KEYS = {
    "transformers_version",
    "architectures",
    "_name_or_path",
    "model_type",
    "id2label",
    "label2id",
    "dtype",
    "torch_dtype",
}
DROPPED_KEYS |= {"auto_map", "quantization_config", "_sliding_window_pattern", "output_hidden_states", "return_dict"}


def full_architecture(spec: dict):
    """The transformers config of the model ``spec`` names (a text model's), read without loading weights.

    random: from the spec; package/assembled: from the converted folder; local: its config.json; hub: the local
    Hugging Face cache, else :data:`KNOWN`."""
    from transformers import AutoConfig  # heavy: transformers, only when a config is rewritten

    source = spec.get("source")
    if source == "random":
        return AutoConfig.for_model(spec.get("architecture", "llama"), **spec.get("config", {}))
    if source in ("package", "assembled"):
        return AutoConfig.from_pretrained(_converted_folder(spec))
    where = spec["path"] if source == "local" else spec["id"]
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True)
    except OSError:
        if where not in KNOWN:
            raise ConfigError(
                f"the dry run needs the architecture of {where!r}: its config.json is not on this machine. Download it "
                f"(huggingface-cli download {where} config.json) or add it to niah.dryrun.KNOWN"
            ) from None
        architecture, fields = KNOWN[where]
        config = AutoConfig.for_model(architecture, **fields)
    return getattr(config, "text_config", None) or config


def pattern_period(layer_types: list[str]) -> int:
    """The shortest p with ``layer_types[i] == layer_types[i % p]`` for every i (1 for a uniform stack)."""
    return next(
        p for p in range(1, len(layer_types) + 1) if all(t == layer_types[i % p] for i, t in enumerate(layer_types))
    )


def tiny_spec(spec: dict) -> dict:
    """A random-weight model spec of the same architecture as ``spec``, narrow and short (see the module doc)."""
    full = full_architecture(spec)
    every = full.to_dict()
    fields = {k: v for k, v in full.to_diff_dict().items() if k not in DROPPED_KEYS}  # what differs from the defaults
    fields.update({k: min(every[k], v) for k, v in NARROW.items() if isinstance(every.get(k), int)})
    # a width transformers accepts (a multiple of the query heads: SmolLM2 has 9) that a weight group of up to 64
    # divides (notebooks 01, 02): SmolLM2 keeps its 576
    step = math.lcm(full.num_attention_heads, 64)
    fields["hidden_size"] = min(full.hidden_size, -(-fields["hidden_size"] // step) * step)
    fields.update(BYTE_VOCAB)
    fields["tie_word_embeddings"] = False
    n = full.num_hidden_layers
    types = list(getattr(full, "layer_types", None) or ["full_attention"] * n)
    keep = min(n, max(4, 2 * pattern_period(types)))
    fields["num_hidden_layers"] = keep
    if getattr(full, "layer_types", None):
        fields["layer_types"] = types[:keep]
    if every.get("head_dim") is None:
        fields["head_dim"] = full.hidden_size // full.num_attention_heads
    if every.get("sliding_window"):
        fields["sliding_window"] = max(16, every["sliding_window"] // SCALE)
    out = {
        "source": "random",
        "architecture": full.model_type,
        "seed": 0,
        "dtype": spec.get("dtype", "float32"),
        "config": fields,
    }
    if spec.get("rope_scaling"):
        out["rope_scaling"] = spec["rope_scaling"]
    return out


ALWAYS = ("niah", "weightquant")  # sections the chain runs whether or not the YAML has them (grid, notebooks 01, 02)
LEFT_OUT = {  # sections a dry run drops, and why
    "llamacpp": "llama.cpp reads the model's GGUF, which a random model has not",
    "cluster": "it runs in one process",
}


def shrunk(name: str, settings: dict) -> dict:
    """Section ``name``'s filled ``settings`` as a dry run asks them: each setting through the ``dry`` rule that
    :mod:`niah.schema` declares for it, an integer kept at or above the setting's ``lowest``."""
    out, meta = {}, SECTIONS[name].settings()
    for k, v in settings.items():
        rule, lowest = meta[k]["dry"], meta[k]["lowest"]
        out[k] = v if not rule or v is None else rule(v)
        if isinstance(out[k], int) and not isinstance(out[k], bool):  # a shrunk count stays a valid one
            out[k] = max(out[k], lowest)
    return out


def dry_config(cfg: Config) -> tuple[dict, list[str]]:
    """``cfg`` (a loaded config) rewritten for a CPU dry run, with every section it asks filled in; and what the
    dry run leaves out, in words."""
    dry = {"name": f"{cfg.name}-dry"}
    dry |= {k: copy.deepcopy(v) for k, v in cfg.raw.items() if k != "name"}
    dry["description"] = (
        f"Dry run of {cfg.name} on the CPU (niah.dryrun): a tiny random model of its architecture; "
        "its answers mean nothing."
    )
    dry["device"] = "cpu"
    dry["threads"] = min(int(cfg.threads), os.cpu_count() or 1)
    for key in ("model", "weight_model"):
        if cfg.raw.get(key):
            dry[key] = tiny_spec(cfg.raw[key])
    for name in SECTIONS:
        if name not in LEFT_OUT and (getattr(cfg, name).present or name in ALWAYS):
            dry[name] = shrunk(name, filled(name, cfg.raw[name]))
    left_out = [f"{key}: ({why})" for key, why in LEFT_OUT.items() if dry.get(key)]
    dry |= {key: {} for key in LEFT_OUT}
    return dry, left_out


def write_dry_config(config: str, run_root: Path | None = None) -> tuple[Path, list[str]]:
    """Write the dry config of ``config`` to ``<run_root>/<name>-dry/dry-config.yaml`` (checked by
    :func:`niah.config.load_config`); return its path and what it left out."""
    loaded = load_config(config)
    cfg, left_out = dry_config(loaded)
    # a companion config is dry-run too: its own dry config, written beside this one, and what it left out
    cfg["companions"] = []
    for other in companion_configs(loaded):
        path, theirs = write_dry_config(other.source, run_root)
        cfg["companions"].append(str(path))
        left_out += [f"{other.name} {why}" for why in theirs]
    folder = (run_root or ROOT / "papermill_runs") / cfg["name"]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "dry-config.yaml"
    tmp = target.with_suffix(".partial")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    tmp.rename(target)
    load_config(str(target))  # the rewritten config passes the same checks as any other
    return target, left_out
