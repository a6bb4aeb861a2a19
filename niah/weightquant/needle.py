"""Needle retrieval under weight schemes x KV-cache methods, paired against fp32 weights with the fp16 cache.

:func:`niah.experiments.grid.run_grid` compares KV methods within one set of weights.  Here the reference of every row
is another set of weights (fp32) on the same cell, so a cell's fp32/fp16 answer distributions are kept in
memory and the loop runs scheme -> cell -> KV method, one prefill per (scheme, cell).  The cells are the
grid's (``niah.experiments.grid.cells`` and its seeded trials) at one length, over the held-out haystack split, so the
calibration text never appears in a context.  Rows (``weightquant_niah.jsonl``) carry the grid's field
names, plus ``weights`` and ``simulated``; ``kl_vs_ref`` and ``top1_vs_ref`` are against fp32/fp16.
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..config import validate
from ..data.haystack import haystack_text, tokenize_haystack
from ..data.needles import NeedleSpec, make_trial
from ..data.prompts import build_cell
from ..experiments.base import Experiment, too_long_reason
from ..experiments.grid import cell_keys, cells, trial_rng
from ..experiments.protocol import compare_logits, context_states, kv_entries, prefill, run_method
from ..experiments.scoring import string_match_all
from ..kv.registry import get_method
from .schemes import FP32, QuantizedModel

REF_METHOD = "fp16"


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


class NeedleBench:
    """Needle cells of ``settings`` (``length``, ``depths``, ``trials``) over the held-out text in ``haystack_folder``."""

    def __init__(self, cfg: dict, lm, settings: dict, haystack_folder: Path, out_path: Path):
        raw = {k: v for k, v in cfg.items() if k != "hash"}
        raw.update(haystack="folder", haystack_folder=str(haystack_folder))
        raw["niah"] = {
            **cfg["niah"],
            "lengths": [settings["length"]],
            "depths": settings["depths"],
            "trials": settings["trials"],
            "methods": [REF_METHOD],
            "reference": REF_METHOD,
        }
        self.cfg, self.lm = validate(raw, f"{cfg['name']} (weightquant needle)"), lm
        n = self.cfg["niah"]
        hay = tokenize_haystack(haystack_text("folder", haystack_folder), lm.tokenizer, settings["length"])
        spec = NeedleSpec(**n["needle"])
        self.cells = cells(self.cfg)
        self.prompts = {
            c: build_cell(lm.tokenizer, hay, c.length, c.depth, make_trial(spec, trial_rng(self.cfg, c)), c.style) for c in self.cells
        }
        self.exp = Experiment(cfg, "weightquant_needles", lm.name, out_path)
        self._ref: dict = {}

    def _row(self, qm: QuantizedModel, cell, method: str) -> dict:
        return self.exp.row(weights=qm.name, simulated=qm.scheme.simulated, **cell_keys(self.cfg, cell), method=method)

    def _too_long(self, cell) -> str | None:
        p = self.prompts[cell]
        return too_long_reason(self.cfg, self.lm, len(p.prefill_ids) + len(p.question_ids), len(p.answer_ids))

    @torch.no_grad()
    def _answers(self, cell, methods: list[str]) -> dict:
        """Prefill the cell once with the model as it is now, then ask through each KV method."""
        p, n = self.prompts[cell], self.cfg["niah"]
        t0 = time.perf_counter()
        kv = context_states(prefill(self.lm.model, p.prefill_ids, chunk=n["prefill_chunk"]))
        prefill_s = time.perf_counter() - t0
        values = kv_entries(kv)
        out = {}
        for m in methods:
            ans, stored, _ = run_method(
                self.lm.model, self.lm.tokenizer, kv, get_method(m), p.question_ids, p.answer_ids, n["max_new_tokens"]
            )
            out[m] = (ans, {"kv_bytes": stored["total"], "bits_per_value": 8 * stored["total"] / values, "prefill_s": prefill_s})
        return out

    def _reference(self, cell):
        """The fp32-weights, fp16-cache answer of ``cell`` (the model must be in its fp32 state)."""
        if cell not in self._ref:
            self._ref[cell] = self._answers(cell, [REF_METHOD])[REF_METHOD][0]
        return self._ref[cell]

    def run(self, qm: QuantizedModel, methods: list[str]) -> pd.DataFrame:
        """Rows of ``qm`` x ``methods`` on every cell (only missing ones are computed)."""
        todo = {c: [m for m in methods if not self.exp.done(self._row(qm, c, m))] for c in self.cells}
        todo = {c: ms for c, ms in todo.items() if ms}
        for c, ms in todo.items():
            reason = self._too_long(c)
            if reason:
                self.exp.fail([self._row(qm, c, m) for m in ms], "too_long", reason)
        todo = {c: ms for c, ms in todo.items() if not self._too_long(c)}
        if qm.name != FP32:
            for c in tqdm(todo, desc="fp32 reference cells", leave=False):
                self._reference(c)
        with qm.applied(self.lm.model):
            for c, ms in tqdm(todo.items(), desc=f"needle {qm.name}", unit="cell"):
                answers = self._answers(c, list(dict.fromkeys([REF_METHOD, *ms]) if qm.name == FP32 else ms))
                if qm.name == FP32:
                    self._ref[c] = answers[REF_METHOD][0]
                for m in ms:
                    ans, extra = answers[m]
                    kl, top1 = compare_logits(self._ref[c].answer_logsoftmax, ans.answer_logsoftmax)
                    p = self.prompts[c]
                    self.exp.write(
                        [
                            {
                                **self._row(qm, c, m),
                                "status": "ok",
                                "reason": "",
                                "expected": p.expected,
                                "generated": ans.text,
                                "score": string_match_all(ans.text, p.expected),
                                "answer_logprob": ans.answer_logprob,
                                "kl_vs_ref": kl,
                                "top1_vs_ref": top1,
                                "context_tokens": len(p.prefill_ids),
                                **extra,
                            }
                        ]
                    )
        df = pd.DataFrame(self.exp.table.rows())
        return df[df["weights"] == qm.name].reset_index(drop=True)
