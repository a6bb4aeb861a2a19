"""The weight-quantization study of notebooks 01 and 02: builds each scheme, measures it, one results row per scheme.

Rows go to ``papermill_runs/<config>/weightquant_results.jsonl`` (a resumable :class:`~niah.results.ResultsTable`
keyed by ``config, model, scheme``; a rerun skips finished schemes).  A row holds the scheme's identity and
provenance, its settings (:meth:`~niah.weightquant.schemes.Scheme.fields`), held-out quality against fp32 (``ppl``,
``ppl_delta``, ``kl_vs_fp32``, ``top1_vs_fp32``), its bytes as stored (``linear_bytes``, ``disk_bytes``,
``memory_bytes``), weight kurtosis, the calibration record, needle accuracy at the shortest needle length (every cell
is in ``weightquant_niah.jsonl``, see :mod:`niah.weightquant.needle`) and, when run, a greedy generation; the scheme
``auto-round W4A8 check`` holds :func:`~niah.weightquant.autoround.w4a8_offer`'s fields.  Every column, and which
rows each claim of seed 003 reads: docs/design-notes.md.
"""

from __future__ import annotations

import json
import time
from functools import cached_property
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..config import Config
from ..experiments.base import provenance
from ..models import cache_dir
from ..report.analysis import summarize
from ..rundir import RunDir
from ..schema import ConfigError
from . import autoround
from .awq import foldable, search_scale
from .cache import cached
from .data import split_keys, split_text, token_windows, windows_hash
from .evaluate import Evaluator, generate, repetition
from .needle import needle_battery, run_needles, usable_methods
from .quant import fake_quant_weight
from .salience import collect_inputs, decoder_linears, kurtosis, shared_inputs, uncoded_weights
from .schemes import (
    QuantizedModel,
    Scheme,
    autoround_default,
    rtn_layers,
    schemes_01,
    with_kept_channels,
    zeroed_layers,
)
from .tables import OFFER


class Study:
    """Everything a notebook needs, made when first used and kept: calibration and evaluation windows,
    activation statistics, AutoRound weights and AWQ scales (cached on disk), the needle bench."""

    def __init__(self, cfg: Config, lm, run_dir: Path):
        self.cfg, self.lm, self.run_dir, self.s = cfg, lm, Path(run_dir), cfg.weightquant
        self.table = RunDir(cfg, self.run_dir).table("weightquant")
        torch.manual_seed(cfg.seed)

    @cached_property
    def calibration(self) -> torch.Tensor:
        c = self.s.calibration
        return token_windows(
            self.lm.tokenizer, split_text("calibration", self.s.calibration_share), c["samples"], c["seqlen"]
        )

    @cached_property
    def evaluator(self) -> Evaluator:
        e = self.s.evaluation
        return Evaluator(
            self.lm.model,
            token_windows(
                self.lm.tokenizer, split_text("evaluation", self.s.calibration_share), e["windows"], e["length"]
            ),
            e["batch"],
        )

    @cached_property
    def stats(self):
        return collect_inputs(self.lm.model, self.calibration, self.s.calibration["sample_tokens"], self.cfg.seed)

    @cached_property
    def kv_methods(self) -> list[str]:
        ok, missing = usable_methods(self.s.kv_methods)
        if missing:
            print(f"KV methods not registered yet, skipped: {missing}")
        return ok

    def _key(self, scheme: Scheme, **extra) -> dict:
        weights = {k: v for k, v in scheme.fields().items() if k in ("w_bits", "group", "w_sym", "rounding")}
        return {
            "model": self.cfg.weights,
            "calibration": windows_hash(self.calibration),
            "seed": self.cfg.seed,
            **weights,
            **extra,
        }

    def _autoround(self, scheme: Scheme):
        a = {**self.s.autoround, **({"iters": scheme.iters} if scheme.iters else {})}
        key = self._key(scheme, autoround=a, version=autoround.version())
        windows = self.calibration[: a["samples"], : a["seqlen"]]
        return cached(
            key,
            lambda: autoround.calibrate(
                self.lm.model,
                self.lm.tokenizer,
                windows,
                scheme.w_bits,
                scheme.group,
                scheme.sym,
                a["iters"],
                a["batch_size"],
                a["amp"],
                self.cfg.seed,
            ),
        )

    def autoround_check(self) -> pd.DataFrame:
        """Is AutoRound's gap to round-to-nearest a matter of iterations?  W4A16 on the first
        ``autoround_check.blocks`` decoder layers only (the others fp32): RTN, AutoRound at this config's iterations
        (those layers of the whole-model calibration) and AutoRound at ``autoround_check.iters`` (auto-round's
        default is 200; tuned on those layers alone, cached).  Per row: held-out perplexity, KL and top-1 against
        fp32, and the calibration's seconds per (block, iteration)."""
        c, a = self.s.autoround_check, self.s.autoround
        S = schemes_01(self.s)
        rtn, ar = S["w4a16_rtn"], S["w4a16_ar"]
        windows = self.calibration[: a["samples"], : a["seqlen"]]
        more = cached(
            self._key(ar, autoround={**a, "iters": c["iters"]}, blocks=c["blocks"], version=autoround.version()),
            lambda: autoround.calibrate(
                self.lm.model,
                self.lm.tokenizer,
                windows,
                ar.w_bits,
                ar.group,
                ar.sym,
                c["iters"],
                a["batch_size"],
                a["amp"],
                self.cfg.seed,
                blocks=c["blocks"],
            ),
        )
        names = list(more.layers)
        whole = self._autoround(ar)
        total = len(self.lm.model.base_model.layers)
        variants = [
            ("RTN", 0, rtn_layers(self.lm.model, rtn), None),
            ("AutoRound", a["iters"], whole.layers, whole.record["wall_s"] / (total * a["iters"])),
            ("AutoRound", c["iters"], more.layers, more.record["wall_s"] / (c["blocks"] * c["iters"])),
        ]
        rows = []
        for rounding, iters, layers, per_block_iter in variants:
            sch = Scheme(
                f"W4A16 {rounding} g{ar.group}, first {c['blocks']} blocks", w_bits=4, group=ar.group, sym=ar.sym
            )
            m = self.evaluator.measure(QuantizedModel(sch, {n: layers[n] for n in names}))
            rows.append(
                {
                    "rounding": rounding,
                    "iters": iters,
                    "blocks": c["blocks"],
                    "layers": len(names),
                    "ppl": m["ppl"],
                    "ppl_fp32": m["ppl_fp32"],
                    "kl_vs_fp32": m["kl_vs_fp32"],
                    "top1_vs_fp32": m["top1_vs_fp32"],
                    "s_per_block_iter": per_block_iter,
                }
            )
        return pd.DataFrame(rows)

    def autoround_default(self, run: bool = False) -> pd.DataFrame | str:
        """The row of :func:`~niah.weightquant.schemes.autoround_default` (its needle cells with every cache of
        ``kv_methods``, paired with fp32's, so the interaction table takes it), measured first when ``run`` (``make
        autoround-200``; a row measured before resumes its missing cells); without ``run``, the row if it was measured
        in this run folder, else a sentence saying how to measure it."""
        sch = autoround_default(self.s)
        if run:
            return self.evaluate([sch], needle={sch.name: self.s.kv_methods})
        rows = self.rows([sch.name])
        if len(rows):
            return rows
        return f"{sch.name}: not measured in this run folder; `make autoround-200 CONFIG={self.cfg.name}` measures it"

    def _awq(self, scheme: Scheme):
        key = self._key(scheme, awq_grid=self.s.awq_grid, sample_tokens=self.s.calibration["sample_tokens"])
        return cached(key, lambda: self._awq_search(scheme))

    def _awq_search(self, scheme: Scheme):
        linears = decoder_linears(self.lm.model)
        groups: dict[str, list[str]] = {}
        for n, first in shared_inputs(self.lm.model).items():
            groups.setdefault(first, []).append(n)
        scales, alphas = {}, {}
        for first, names in tqdm(groups.items(), desc=f"AWQ search W{scheme.w_bits}", unit="group"):
            if not foldable(first, linears):
                continue
            st = self.stats[first]
            r = search_scale(
                [linears[n].weight for n in names],
                st.sample,
                st.mean_abs,
                lambda w: fake_quant_weight(w, scheme.w_bits, scheme.group, scheme.sym),
                self.s.awq_grid,
            )
            alphas[first] = r.alpha
            scales.update({n: r.scale for n in names})
        return rtn_layers(self.lm.model, scheme, scales), {
            "alphas": alphas,
            "grid": self.s.awq_grid,
            "unscaled": [g for g in groups if g not in alphas],
        }

    def build(self, scheme: Scheme) -> tuple[QuantizedModel, dict]:
        """The scheme's model and a record of its calibration (empty for uncalibrated schemes)."""
        model, record = self.lm.model, {}
        if scheme.zero:
            return QuantizedModel(scheme, zeroed_layers(model, scheme, self.stats)), record
        if scheme.w_bits >= 16:
            return QuantizedModel(scheme), record
        if scheme.rounding in ("autoround", "awq"):
            c = self._autoround(scheme) if scheme.rounding == "autoround" else self._awq(scheme)
            layers, record = c.layers, {**c.record, "cache_hit": c.hit, "checkpoint_file_bytes": c.file_bytes}
        elif scheme.rounding == "rtn":
            layers = rtn_layers(model, scheme)
        else:
            raise ValueError(f"unknown rounding {scheme.rounding!r}: use rtn, autoround or awq")
        if scheme.keep:
            layers = with_kept_channels(
                model, layers, scheme, self.stats if scheme.keep_by == "activation" else {}, self.cfg.seed
            )
        return QuantizedModel(scheme, layers), record

    @cached_property
    def _weights_facts(self) -> dict:
        model = self.lm.model
        ws = [m.weight for m in decoder_linears(model).values()]
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return {
            "kurtosis_fp32": kurtosis(*ws),
            "kurtosis_max_layer": max(kurtosis(w) for w in ws),
            "memory_bytes": params,
            "other_bytes": params - sum(w.numel() * w.element_size() for w in ws),
            "linear_weights": sum(w.numel() for w in ws),
        }

    def _base(self, name: str) -> dict:
        return {**provenance(self.cfg, self.lm.name), "scheme": name, "status": "ok"}

    def evaluate(
        self, schemes: list[Scheme], needle: dict[str, list[str]] | None = None, generate_for: tuple[str, ...] = ()
    ) -> pd.DataFrame:
        """Evaluate every scheme not yet in the table; ``needle[name]``: KV methods of its needle cells;
        ``generate_for``: names that also generate ``generate_tokens`` greedy tokens.  Returns the rows of
        ``schemes``."""
        needle = needle or {}
        for sch in schemes:
            done = self.table.key(self._base(sch.name)) in self.table.done
            if done and sch.name not in needle:  # a finished row with needle cells still resumes its missing cells
                continue
            t0 = time.perf_counter()
            qm, record = self.build(sch)
            found = self._needle_fields(qm, needle[sch.name]) if sch.name in needle else {}  # resumes missing cells
            if done:
                continue
            facts = self._weights_facts
            linear = qm.linear_bytes(self.lm.model)
            zero_count = sum(int((w == 0).sum()) for w in qm.dense.values())
            zeros = zero_count / max(sum(w.numel() for w in qm.dense.values()), 1)
            c = self.s.calibration
            row = {
                **self._base(sch.name),
                **sch.fields(),
                **self.evaluator.measure(qm),
                "linear_bytes": linear,
                "bits_per_weight": linear * 8 / facts["linear_weights"],  # counted from the stored tensors
                "disk_bytes": linear + facts["other_bytes"],
                "memory_bytes": facts["memory_bytes"],
                "checkpoint_file_bytes": record.pop("checkpoint_file_bytes", None),
                "zero_fraction": zeros if sch.zero else 0.0,
                "kurtosis_fp32": facts["kurtosis_fp32"],
                "kurtosis_max_layer": facts["kurtosis_max_layer"],
                "calibration_hash": windows_hash(self.calibration),
                "calibration_samples": c["samples"],
                "calibration_seqlen": c["seqlen"],
                "calibration_share": self.s.calibration_share,
                "calibrated": record,
            }
            row["ppl_delta"] = row["ppl"] - row["ppl_fp32"]
            row.update(found)
            if sch.name in generate_for:
                prompt = self.evaluator.windows[0, : self.s.prompt_tokens].tolist()
                with qm.applied(self.lm.model):
                    ids = generate(self.lm.model, prompt, self.s.generate_tokens)
                row.update(repetition(ids), generated_tokens=len(ids), generated_text=self.lm.tokenizer.decode(ids))
            row["eval_s"] = round(time.perf_counter() - t0, 1)
            self.table.append(row)
        return self.rows([s.name for s in schemes])

    def needle_plan(self, schemes: dict[str, Scheme]) -> dict[str, list[str]]:
        """``{scheme name: KV methods}`` for the schemes of ``weightquant.needle_schemes`` (keys of ``schemes``)."""
        unknown = sorted(set(self.s.needle_schemes) - set(schemes))
        if unknown:
            raise ConfigError(
                f"weightquant.needle_schemes: unknown scheme(s) {unknown}; choose from {', '.join(schemes)}"
            )
        return {schemes[k].name: self.kv_methods for k in self.s.needle_schemes}

    def _needle_fields(self, qm: QuantizedModel, methods: list[str]) -> dict:
        path = RunDir(self.cfg, self.run_dir).file("weightquant_needles")
        df = run_needles(self.cfg, self.lm, qm, [m for m in methods if m in self.kv_methods], path)
        L = min(self.s.needle_lengths)
        ok = df[(df["method"] == "fp16") & (df["length"] == L)] if len(df) else df
        s = summarize(ok, ["weights"]).iloc[0] if len(ok) else None
        if s is None or not s["n"]:
            return {"needle_length": L, "needle_n": 0}
        return {
            "needle_length": L,
            "needle_n": int(s["n"]),
            "needle_accuracy": s["accuracy"],
            "needle_ci_low": s["ci_low"],
            "needle_ci_high": s["ci_high"],
            "needle_answer_logprob": s["answer_logprob"],
        }

    def rows(self, names: list[str] | None = None) -> pd.DataFrame:
        df = pd.DataFrame(self.table.rows())
        if names is not None and len(df):
            df = (
                df[df["scheme"].isin(names)]
                .set_index("scheme")
                .loc[[n for n in names if n in set(df["scheme"])]]
                .reset_index()
            )
        return df

    def record_offer(self) -> dict:
        """Claim S3-10: what the installed auto-round offers for W4A8 (checked once per version, cached), as a table
        row."""
        path = cache_dir() / "weightquant" / f"autoround-{autoround.version()}-w4a8-offer.json"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(autoround.w4a8_offer(), indent=1))
        offer = json.loads(path.read_text())
        self.table.append({**self._base(OFFER), **offer})
        return offer

    def describe(self) -> pd.DataFrame:
        """The data and settings behind the numbers: splits, windows, AutoRound and needle settings."""
        calib, held = split_keys(self.s.calibration_share)
        c, e, b = self.s.calibration, self.s.evaluation, needle_battery(self.cfg)
        facts = {
            "calibration split": f"{len(calib)} pydoc topic keys (sha256 rule, share {self.s.calibration_share})",
            "evaluation split": f"{len(held)} other topic keys; perplexity, KL, generation prompt and needle haystack",
            "calibration windows": f"{c['samples']} x {c['seqlen']} tokens (hash {windows_hash(self.calibration)})",
            "evaluation windows": f"{e['windows']} non-overlapping x {e['length']} tokens = "
            f"{e['windows'] * (e['length'] - 1)} predicted tokens",
            "AutoRound": "iters {iters}, {samples} of the calibration windows cut to {seqlen} tokens, "
            "batch {batch_size}, amp (bf16) {amp}".format(**self.s.autoround)
            + f", group {self.s.group}",
            "needle cells": f"the battery's questions at {self.s.needle_lengths} tokens: "
            f"{b.contexts} contexts x {b.needles} "
            f"needles ({b.depths} depths, {b.mode} mode) per length, over the whole {self.cfg.haystack} haystack "
            f"(calibration topics included); KV methods {self.kv_methods}; schemes {self.s.needle_schemes}",
        }
        uncoded = uncoded_weights(self.lm.model)
        if uncoded:
            total = sum(p.numel() for p in self.lm.model.base_model.layers.parameters())
            facts["left at full precision"] = (
                f"{sum(uncoded.values()) / total:.0%} of the decoder's weights "
                f"({len(uncoded)} tensors outside nn.Linear, "
                f"e.g. {next(iter(uncoded))}): no scheme here quantizes fused expert tensors yet"
            )
        return pd.DataFrame({"value": facts})
