"""Every config setting, with its default and what it means, in one place.

A config file (``configs/<name>.yaml``) overrides any of these.  :func:`niah.config.load_config` fills in the
defaults and checks the whole file when it loads, every section included, so a typo fails at once rather than
an hour into a run; the readers of each section (:func:`section` and the ``*_settings`` functions beside the
experiments) add the checks that need more than one setting.
"""

from __future__ import annotations

import copy


class ConfigError(ValueError):
    """A config file is missing, malformed or asks for something impossible; the message says which and how to fix it."""


TOP = {
    "device": "cpu",  # or cuda
    "threads": 2,  # torch threads on the CPU
    "seed": 1234,  # every needle, value and sampled window derives from it
    "haystack": "pydoc",  # pydoc (CPython's pydoc_data.topics), noise (RULER's filler) or folder
    "haystack_folder": "data/haystack",  # the .txt files of haystack: folder
}

NIAH = {  # the needle grid, and what the battery, sweep and llama.cpp runs share with it
    "lengths": [1024, 2048],  # context lengths in tokens
    "depths": [0.0, 0.25, 0.5, 0.75, 1.0],  # needle depth in the context: 0 = start, 1 = end
    "trials": 1,  # seeded trials per (length, depth)
    "needle": {"kind": "number", "variant": "single", "count": 4},  # niah.data.needles.NeedleSpec
    "prompt_styles": ["completion"],  # niah.data.prompts.STYLES
    "methods": ["fp16"],  # KV methods (niah.kv.registry)
    "reference": "fp16",  # the method every other is paired against
    "max_new_tokens": 12,  # greedy answer tokens at most
    "prefill_chunk": 1024,  # tokens per prefill forward pass
    # the prompt chunk of methods read in vLLM's engine mode (name@engine): vLLM 0.34.0's default max_num_batched_tokens
    # on a >= 70 GiB GPU (H100, H200) with the LLM class (engine/arg_utils.py, get_batch_defaults); `vllm serve` uses 8192 there
    "engine_chunk": 16384,
}

BATTERY = {  # notebook 03's needle questions (niah.experiments.battery)
    "lengths": [4096, 8192, 16384],
    "contexts": 5,  # stretches of haystack, each asked at every length
    "needles": 10,  # questions per length and context
    "depths": "spread",  # single mode: "spread" (0, 1/(n-1), ..., 1) or "centred" ((k + 1/2)/n: no needle at either end)
    "mode": "single",  # one needle per prompt; "multi_key": every needle of a context in one prompt (distractors)
    "nested": True,  # multi_key: one context serves every length (False: separate contexts per length, fewer distractors)
    "methods": None,  # None: niah.methods
    "sliding_layers": "quantize",  # or "fp16": sliding-window layers kept at fp16 (PackedCache)
}

SWEEP = {  # notebook 04's stepped pressure sweep (niah.experiments.sweep)
    "lengths": [1, 256, 512, 1024, 2048],  # context lengths, prefilled in order, one cache grown through them
    "methods": ["fp16"],
    "decode_steps": 32,  # paired greedy decode steps per length (TPOT)
    "hz": 50,  # memory sampling rate
    "memory_budget_gib": None,  # lengths whose fp32 context exceeds it get oom rows instead of a run
    "cold_warm": None,  # e.g. {"target": 16384, "warmup": 4096, "repeats": 3}: TTFT at target, cold and after a warm-up
}

KV_PERPLEXITY = {  # held-out text read through each stored cache (niah.experiments.kvppl)
    "methods": ["fp16"],
    "windows": 4,  # held-out windows
    "context": 2048,  # tokens stored by each method
    "continuation": 256,  # tokens scored over the stored context
    "breakdown": [],  # per method, rows with only these parts quantized: keys, values, full (layers), sliding (layers)
    "breakdown_methods": None,  # the listed methods that get breakdown rows; None: every one
}

LLAMACPP = {  # llama.cpp side by side on the battery's questions (niah.experiments.llamacpp)
    "lengths": None,  # battery lengths to ask at; None: the battery's shortest
    "contexts": 1,  # the battery's first contexts
    "kv": ["f16", "q8_0", "q4_0"],  # llama.cpp cache types (f16 is the reference)
    "rotation": [True, False],  # quantized types with llama.cpp's Hadamard rotation and without it
}

WEIGHTQUANT = {  # notebooks 01 and 02 (niah.weightquant); the sizes are the knobs of the CPU budget
    "calibration_share": 0.25,  # share of pydoc topic keys used for calibration (see weightquant.data.split_keys)
    "calibration": {"samples": 16, "seqlen": 256, "sample_tokens": 1024},  # sample_tokens: kept per layer input for AWQ
    "evaluation": {"windows": 8, "length": 512, "batch": 2},
    "group": 64,  # weights per scale
    "autoround": {"iters": 10, "samples": 8, "seqlen": 128, "batch_size": 8, "amp": False},  # the first calibration windows, cut to seqlen
    # W4A16 on the first `blocks` decoder layers: RTN, AutoRound at `autoround.iters` and at `iters` (auto-round's default)
    "autoround_check": {"blocks": 2, "iters": 200},
    "outlier_share": 0.01,  # W4A8: input channels kept in int8 weights (S3-2)
    "salient_share": 0.01,  # AWQ's experiment: input channels kept in fp16 (S3-5)
    "salient_bits": [3, 4],
    "zero_share": 0.3,  # channel mask and magnitude pruning (S3-4)
    "awq_grid": 20,  # scale exponents searched per layer
    # the weights x KV cells: the battery's questions at these lengths (niah.weightquant.needle); contexts / needles
    # None: the battery's (a different number asks other questions than notebook 03's)
    "needle_lengths": [4096],
    "needle": {"contexts": None, "needles": None},
    "needle_schemes": ["fp32", "w8a8_sym", "w4a16_ar", "w4a8", "w4a8_outliers"],  # keys of schemes_01 with needle cells
    "kv_methods": ["fp16", "q8_0", "q4_0", "turboquant_k8v4@engine"],
    "generate_tokens": 300,  # greedy tokens per scheme for the repetition check
    "prompt_tokens": 32,
}

CLUSTER = {  # scale-out on Ray (niah.cluster): the section's presence, or --cluster ADDRESS, turns it on
    "engine": "ray",
    "address": None,  # None: a local cluster started by the run; "auto": the running one; "ray://host:10001": a remote head
    "workers": 2,  # Ray actors, each with one copy of the model
    "gpus_per_worker": 0,  # GPUs per actor (1: one model per GPU; more: the model spread with device_map)
    "cpus_per_worker": 1,  # CPUs per actor, and its torch threads
}

SECTIONS = {
    "battery": BATTERY,
    "sweep": SWEEP,
    "kv_perplexity": KV_PERPLEXITY,
    "llamacpp": LLAMACPP,
    "weightquant": WEIGHTQUANT,
    "cluster": CLUSTER,
}


def section(cfg: dict, name: str) -> dict:
    """The config's section ``name`` over its defaults (a fresh copy; nested mappings merged one level deep).

    Raises :class:`ConfigError` naming an unknown setting and the valid ones."""
    defaults = SECTIONS[name]
    given = cfg.get(name) or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{name} must be a mapping of settings; got {given!r}")
    out = copy.deepcopy(defaults)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown {name} setting(s) {unknown}; valid: {', '.join(sorted(defaults))}")
    check_types(name, defaults, given)
    for k, v in given.items():
        if isinstance(defaults[k], dict):
            bad = sorted(set(v) - set(defaults[k]))
            if bad:
                raise ConfigError(f"unknown {name} setting(s) {name}.{k}.{bad}; valid: {', '.join(sorted(defaults[k]))}")
            out[k].update(v)
        else:
            out[k] = v
    return out


_KINDS = ((bool, "true or false"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "a list"), (dict, "a mapping"))
INT_MAX = 2**63 - 1  # torch's largest integer (int64)
LOWEST = {"seed": 0, "cluster.gpus_per_worker": 0}  # every other integer setting is a count or a size: at least 1


def check_types(where: str, defaults: dict, given: dict) -> None:
    """Every setting of ``given`` (and of its mappings, one level down) is of its default's kind: a number where
    the default is a float, never a bool where it is an int, anything where it is None.  An integer setting is a
    count or a size (``seed`` excepted: 0 or more) from 1 to :data:`INT_MAX`, and a list whose default holds
    integers (lengths, bits) is a non-empty list of such.  ``where`` prefixes the names in the message (``""``
    for top-level settings).  Raises :class:`ConfigError` naming the setting, the kind it takes and what it got."""
    for key, value in given.items():
        default, name = defaults[key], f"{where}.{key}" if where else key
        if default is None:
            continue
        kind, words = next((k, w) for k, w in _KINDS if isinstance(default, k))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise ConfigError(f"{name} must be {words} (its default is {default!r}); got {value!r}")
        if kind is int and not LOWEST.get(name, 1) <= value <= INT_MAX:
            raise ConfigError(f"{name} must be an integer from {LOWEST.get(name, 1)} to 2**63 - 1 (torch's largest); got {value!r}")
        if kind is list and default and all(type(x) is int for x in default):
            if not value or not all(type(x) is int and 1 <= x <= INT_MAX for x in value):
                raise ConfigError(f"{name} must be a non-empty list of positive integers up to 2**63 - 1 (torch's largest); got {value!r}")
        if kind is dict:
            check_types(name, default, {k: v for k, v in value.items() if k in default})
