"""Needle retrieval under weight schemes x KV-cache methods: notebook 03's battery, asked with each scheme's weights.

The questions, prompts and scoring are the battery's (:mod:`niah.experiments.battery`), at the lengths
``weightquant.needle_lengths``: with the battery's own settings when every one of those lengths is a battery
length (then the fp32 rows answer the same questions as notebook 03's), else a battery of those lengths alone
(``weightquant.needle`` may set its ``contexts`` and ``needles``).  One prefill per (scheme, question) serves
every KV method, so a scheme costs its prefills; rows (``weightquant_niah.jsonl``) are battery rows plus
``weights`` and ``simulated``, and their ``kl_vs_ref`` is against the same weights' fp16 cache.
:func:`niah.report.tables.weights_kv_table` pairs each cell with fp32 weights and the fp16 cache on the same
questions, and :func:`~niah.report.tables.interaction_table` asks whether a KV method costs more on quantized weights
than on fp32 ones.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from ..config import Config
from ..experiments.base import Experiment
from ..experiments.battery import ask_battery, battery_contexts, battery_plan
from ..kv.registry import get_method
from ..rundir import open_table
from ..schema import Battery
from .schemes import REF_METHOD, QuantizedModel


def usable_methods(names: list[str]) -> tuple[list[str], list[str]]:
    """(KV methods the registry knows, those it does not yet), keeping ``fp16`` first."""
    ok, missing = [], []
    for m in dict.fromkeys([REF_METHOD, *names]):
        try:
            get_method(m)
            ok.append(m)
        except ValueError:
            missing.append(m)
    return ok, missing


def needle_battery(cfg: Config) -> Battery:
    """The battery settings whose questions the weights x KV cells ask (see the module docstring)."""
    s, w = cfg.battery, cfg.weightquant
    lengths = sorted(w.needle_lengths)
    # the battery's own questions only where every needle length is one of its lengths; else a battery of those alone
    if not s.present or not set(lengths) <= set(s.lengths):
        s = replace(s, lengths=lengths)
    # the weights x KV cells ask every kv_method at every needle length: the battery's method_lengths are its own
    return replace(s, method_lengths={}, **{k: v for k, v in w.needle.items() if v is not None})


def run_needles(cfg: Config, lm, qm: QuantizedModel, methods: list[str], path) -> pd.DataFrame:
    """Ask the weights x KV questions of ``qm`` (applied to ``lm.model`` meanwhile) through ``methods``; its rows.
    The battery's steps (:func:`~niah.experiments.battery.run_battery`) on settings :func:`needle_battery`, into
    their own table, each row tagged with its weights, and never on a cluster (its workers load the config's own
    weights)."""
    with qm.applied(lm.model):
        s = needle_battery(cfg)
        exp = Experiment(cfg, "weightquant_needles", lm.name, path)
        tag = {"weights": qm.name, "simulated": qm.scheme.simulated}
        plan = battery_plan(cfg, lm, s, methods, cfg.weightquant.needle_lengths, tag)
        ask_battery(exp, lm, plan, battery_contexts(cfg, lm, s), f"needles {qm.name}")
    df = pd.DataFrame(open_table(cfg, "weightquant_needles", path).rows())
    return df[df["weights"] == qm.name].reset_index(drop=True) if len(df) else df
