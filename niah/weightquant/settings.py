"""The ``weightquant:`` section of a config: defaults, and a clear error for an unknown key.

Sizes are the knobs of the CPU budget: calibration windows (AutoRound uses the first ``autoround.samples``
of them, cut to ``autoround.seqlen``), evaluation windows, AutoRound iterations, AWQ's grid, needle cells.
"""

from __future__ import annotations

import json

from ..config import ConfigError

DEFAULTS = {
    "calibration_share": 0.25,  # share of pydoc topic keys used for calibration (see data.split_keys)
    "calibration": {"samples": 16, "seqlen": 256, "sample_tokens": 1024},  # sample_tokens: kept per layer input for AWQ
    "evaluation": {"windows": 8, "length": 512, "batch": 2},
    "group": 64,
    "autoround": {"iters": 10, "samples": 8, "seqlen": 128, "batch_size": 8, "amp": False},  # the first calibration windows, cut to seqlen
    "outlier_share": 0.01,  # W4A8: input channels kept in int8 weights (S3-2)
    "salient_share": 0.01,  # AWQ's experiment: input channels kept in fp16 (S3-5)
    "salient_bits": [3, 4],
    "zero_share": 0.3,  # channel mask and magnitude pruning (S3-4)
    "awq_grid": 20,
    "needle": {"length": 4096, "depths": [0.25, 0.75], "trials": 1},
    "kv_methods": ["fp16", "q8_0", "q4_0", "turbo3"],
    "generate_tokens": 300,
    "prompt_tokens": 32,
}


def settings(cfg: dict) -> dict:
    """The config's ``weightquant`` section over :data:`DEFAULTS`; unknown keys are errors."""
    out = json.loads(json.dumps(DEFAULTS))
    for k, v in cfg.get("weightquant", {}).items():
        if k not in DEFAULTS:
            raise ConfigError(f"unknown setting weightquant.{k}; valid settings: {', '.join(DEFAULTS)}")
        if isinstance(DEFAULTS[k], dict):
            bad = set(v) - set(DEFAULTS[k])
            if bad:
                raise ConfigError(f"unknown setting(s) weightquant.{k}.{sorted(bad)}; valid: {', '.join(DEFAULTS[k])}")
            out[k].update(v)
        else:
            out[k] = v
    return out
