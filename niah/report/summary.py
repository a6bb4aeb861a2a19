"""The headline results of one run as Markdown: what ``python -m niah summary`` prints, what the chain writes
to ``papermill_runs/<name>/summary.md``, and what ``make readme-results`` copies to ``results/<name>/summary.md``
and into the README between its results markers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from ..config import Config
from ..rundir import RunDir
from ..weightquant.source import SOURCE_FORMATS, decoder_bits
from ..weightquant.tables import view
from .analysis import accuracy_table, at_lengths, read_mode_table
from .stats import paired_table
from .tables import agreement_table, interaction_table, perplexity_table, speed_table, weights_kv_table

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


class NoResults(FileNotFoundError):
    """The run folder has no needle rows to summarize; the message says why."""


def _needle_rows(run: RunDir) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = run.rows("needles")
    if not len(rows):
        raise NoResults(f"no results in {run.path}: run `make reproduce CONFIG={run.cfg.source or run.cfg.name}` first")
    ok = rows[rows["status"] == "ok"]
    if not len(ok):
        counts = ", ".join(f"{n} {s}" for s, n in rows["status"].value_counts().items())
        raise NoResults(f"no ok rows in {run.file('needles')} ({counts}); the first reason: {rows['reason'].iloc[0]}")
    return rows, ok


def _simd(env: dict) -> str:
    """`` (AVX512 kernels, AMX)``: the instruction set torch's CPU kernels use, and AMX where the CPU has it."""
    if not env.get("torch_cpu_capability"):
        return ""
    return f" ({env['torch_cpu_capability']} kernels{', AMX' if 'amx_tile' in env.get('cpu_simd', []) else ''})"


def _driver(gpu: dict) -> str:
    return f" (driver {gpu['driver']})" if gpu.get("driver") else ""


def machine_line(env: dict) -> str:
    """The machine of an environment record (:func:`niah.env.environment_record`) in one line."""
    if not env:
        return "not recorded"
    gpus = ", ".join(g.get("name", "GPU") + _driver(g) for g in env.get("gpus", [])) or "no GPU"
    return (
        f"{env.get('cpu', '?')}{_simd(env)}, {env.get('cpu_count', '?')} cores, "
        f"{env.get('memory_gib', '?')} GiB, {gpus}"
    )


def _header(run: RunDir, ok: pd.DataFrame) -> str:
    env = json.loads((run.path / "environment.json").read_text()) if (run.path / "environment.json").exists() else {}
    machine = machine_line(env)
    partial = run.path / "timing_partial.json"
    source = run.timing if run.timing.exists() else partial  # no full chain yet: the `--only` runs' sum
    timing = json.loads(source.read_text()) if source.exists() else {}
    how = "" if source == run.timing else ", summed over separate `--only` runs"
    per_nb = ", ".join(f"{k[:2]} {v:.0f} s" for k, v in sorted(timing.items()) if k.endswith(".ipynb"))
    wall = f"{timing['total'] / 60:.1f} min of notebooks ({per_nb}{how})" if timing else "not recorded (no timing.json)"
    if timing.get("earlier_runs_s"):  # a notebook run again by a later `--only` run (resuming its rows)
        runs = timing["earlier_runs_s"]
        which = ", ".join(f"{k[:2]} {' + '.join(f'{t:.0f}' for t in v)} s" for k, v in sorted(runs.items()))
        wall += (
            f", after earlier runs of the same notebooks ({which}): {timing['total_with_earlier'] / 60:.1f} min in all"
        )
    if timing.get("interrupted_runs_s"):
        cut = timing["interrupted_runs_s"]
        wall += (
            f", after {len(cut)} interrupted run(s) of {sum(cut) / 60:.1f} min: "
            f"{timing['total_with_interrupted'] / 60:.1f} min in all"
        )
    return (
        f"Config `{run.cfg.name}`, model {ok['model'].iloc[0]}, commit {ok['git_commit'].iloc[0]}, "
        f"last row {ok['time'].max()}; machine: {machine}; chain wall time: {wall}."
    )


def _paired(ok: pd.DataFrame, ref: str) -> pd.DataFrame:
    t = paired_table(ok, ref)
    t = t[t["method"] != ref]
    return pd.DataFrame(
        {
            "method": t["method"],
            "length": t["length"],
            "n": t["n"],
            "accuracy": [
                f"{a:.2f} [{lo:.2f}, {hi:.2f}]" for a, lo, hi in zip(t["accuracy"], t["ci_low"], t["ci_high"])
            ],
            "fp16": t["ref_accuracy"].round(2),
            "losses/gains": [f"{a}/{b}" for a, b in zip(t["losses"], t["gains"])],
            "McNemar p": t["p"].map(lambda p: f"{p:.3g}"),
            "log-prob diff [95%]": [
                f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"
                for d, lo, hi in zip(t["logprob_diff"], t["logprob_low"], t["logprob_high"])
            ],
            "min detectable drop": t["min_detectable_drop"].round(2),
        }
    )


def _perplexity(rows: pd.DataFrame, ref: str) -> pd.DataFrame:
    t = perplexity_table(rows, ref)
    return pd.DataFrame(
        {
            "method": t["method"],
            "windows": t["windows"],
            "bits/value": t["bits_per_value"].round(2),
            f"ppl vs {ref} [95%]": [
                f"{r:.3f} [{lo:.3f}, {hi:.3f}]" for r, lo, hi in zip(t["ppl_vs_ref"], t["ci_low"], t["ci_high"])
            ],
            "KL": t["kl_vs_ref"].map(lambda k: f"{k:.3g}"),
            "top-1": t["top1_vs_ref"].round(3),
        }
    )


def _ledger_counts(run: RunDir) -> str:
    csv = run.ledger.with_suffix(".csv")
    if not csv.exists():
        return "not written (notebook 05 did not run)"
    verdicts = pd.read_csv(csv)["verdict"].fillna("").map(lambda v: re.split(r"[ (]", v.strip())[0] or "?")
    counts = verdicts.value_counts()
    return ", ".join(
        f"{counts[v]} {v}" for v in ("supported", "refuted", "partly", "inconclusive", "untestable") if v in counts
    )


def _weights_parts(cfg: Config, run: RunDir) -> list[str]:
    """Notebook 01's source formats, weight schemes, weights x KV table, the interaction and the AutoRound check,
    where the run has them."""
    s, parts = cfg.weightquant, []
    formats = run.path / SOURCE_FORMATS
    if formats.exists():  # a GGUF dequantized to fp32: what the "fp32" reference really is
        table = pd.read_csv(formats, keep_default_na=False)
        parts += [
            "\n**The source file's formats** (notebook 01 read them from the GGUF the fp32 weights were "
            f"dequantized from; decoder linears {decoder_bits(table):.2f} bits per weight as shipped):\n",
            table.to_markdown(index=False),
        ]
    schemes = run.rows("weightquant")
    if len(schemes) and (schemes["status"] == "ok").any():
        parts += [
            "\n**Weight schemes** (notebooks 01 and 02: held-out perplexity, KL and top-1 against fp32, bits per "
            "weight counted from the stored tensors, needle accuracy at the weights x KV cells' length, fp16 cache):\n",
            view(schemes[schemes["status"] == "ok"]).to_markdown(index=False),
        ]
    rows = run.rows("weightquant_needles")
    if len(rows):
        rows = rows[rows["method"].isin(s.kv_methods) & rows["length"].isin(s.needle_lengths)]
    if len(rows) and (rows["status"] == "ok").any():
        table = weights_kv_table(rows, cfg.seed)
        cols = ["weights", "kv", "length", "n", "accuracy", "ci_low", "ci_high", "losses", "gains", "p"]
        cols += ["logprob_diff", "logprob_low", "logprob_high"]
        parts += [
            "\n**Weights x KV cache** (notebook 01; the battery's questions, "
            "each cell against fp32 weights + fp16 cache on the "
            "same questions: McNemar's exact p, answer log-prob difference with a paired bootstrap interval):\n",
            table[cols].round(3).to_markdown(index=False),
        ]
        inter = interaction_table(rows, cfg.seed)
        if len(inter):
            parts += [
                "\n**Interaction**: the KV method's answer log-prob cost on the scheme's weights "
                "minus its cost on fp32 "
                "(difference-in-differences, paired bootstrap), and the same for accuracy:\n",
                inter.round(3).to_markdown(index=False),
            ]
    check = run.path / "weightquant_autoround_check.csv"
    if check.exists():
        parts += [
            "\n**AutoRound against round-to-nearest** "
            "(W4A16 on the first blocks only, the rest fp32; held-out perplexity):\n",
            pd.read_csv(check).round(4).to_markdown(index=False),
        ]
    return parts


def summary_markdown(cfg: Config, folder: str | Path | None = None) -> str:
    """The run's headline tables as Markdown (raises :class:`NoResults` without ``ok`` needle rows)."""
    run = RunDir(cfg, folder)
    rows, ok = _needle_rows(run)
    ref = cfg.niah.reference
    parts = [
        _header(run, ok),
        "\n**Needle accuracy** per method and length "
        f"(95% Wilson interval, n questions; {cfg.niah.needle['kind']} needles):\n",
        accuracy_table(rows, ref).to_markdown(),
        f"\n**Against {ref} on the same questions**: "
        "McNemar's exact test on the paired right/wrong outcomes, the answer "
        "log-prob difference with a paired bootstrap interval, and the smallest drop this n can detect:\n",
        _paired(ok, ref).to_markdown(index=False),
    ]
    modes = read_mode_table(ok)
    if len(modes):
        parts += [
            "\n**Read modes**: each method asked both `strict` and `@engine`, "
            "the engine read paired against the strict one "
            "on the same questions (losses/gains: engine's), with the mean KL of each against the reference:\n",
            modes.round(4).to_markdown(index=False),
        ]
    ppl = run.rows("kv_perplexity")
    if len(ppl) and ref in set(ppl.loc[ppl["status"] == "ok", "method"]):
        parts += [
            "\n**Perplexity through the stored cache** "
            f"(held-out text scored over each method's stored context; ratio to {ref} "
            "with a 95% bootstrap interval over windows, KL against it):\n",
            _perplexity(ppl, ref).to_markdown(index=False),
        ]
    sweep = run.rows("sweep")
    if len(sweep) and (sweep["status"] == "ok").any():
        parts += [
            "\n**Pressure sweep** (ratios to the fp16 cache in the same run):\n",
            at_lengths(sweep, ref=ref).round(3).to_markdown(index=False),
        ]
    lcpp = run.rows("llamacpp")
    if len(lcpp) and (lcpp["status"] == "ok").any():
        parts += [
            "\n**llama.cpp side by side**: its own caches on the same GGUF file and token ids, "
            "against this repo's emulation "
            "of each format (`_norot`: without llama.cpp's Hadamard rotation), "
            "then its speed and session state per cache:\n",
            agreement_table(lcpp, ok).round(3).to_markdown(index=False),
            "",
            speed_table(lcpp).round(3).to_markdown(index=False),
        ]
    parts += _weights_parts(cfg, run)
    parts += [
        f"\n**Claims ledger**: {_ledger_counts(run)} "
        "(of the claims in `claims/claims.yaml`; the report has each verdict)."
    ]
    return "\n".join(parts) + "\n"


README_CONFIG = "cpu"  # the config whose summary the README's results block shows (the default chain)


def write_results(cfg: Config, readme: Path | None, results_root: Path, folder: str | Path | None = None) -> Path:
    """Write ``results/<name>/summary.md`` and put it into ``readme`` between :data:`BEGIN` and :data:`END` (None: the
    summary file only)."""
    text = summary_markdown(cfg, folder)
    target = results_root / cfg.name / "summary.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    if readme is None:
        return target
    body = readme.read_text(encoding="utf-8")
    if BEGIN not in body or END not in body:
        raise NoResults(f"{readme} has no {BEGIN} ... {END} block to fill")
    head, rest = body.split(BEGIN, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}", encoding="utf-8")
    return target
