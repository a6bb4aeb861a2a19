"""Small helpers that keep notebook cells to a few lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from . import env
from .config import ROOT, Config, companion_configs, load_config
from .models import load_model
from .report.analysis import kv_value_share
from .report.claims import gather_evidence, ledger
from .rundir import RunDir, settings_hash
from .weightquant import source


def setup(config: str, run_dir: str | None = None, figures_dir: str | None = None) -> tuple[dict, RunDir, Path]:
    """Load the config; resolve (and create) the run and figure folders."""
    cfg = load_config(config)
    run = RunDir(cfg, run_dir)
    figs = Path(figures_dir) if figures_dir else ROOT / "figures" / cfg.name
    run.path.mkdir(parents=True, exist_ok=True)
    figs.mkdir(parents=True, exist_ok=True)
    env.use_threads(cfg.threads)
    return cfg, run, figs


def load(cfg: Config, role: str = "needles"):
    """The config's model for ``role``: ``needles`` (``model:``, notebooks 00, 03, 04) or ``weights``
    (``weight_model:`` where the config names one, else ``model:``; notebooks 01 and 02)."""
    return load_model(cfg.weights if role == "weights" else cfg.model, device=cfg.device)


def save_json(obj, path: Path) -> None:
    """Write JSON atomically (a kill never leaves half a file)."""
    tmp = Path(str(path) + ".partial")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def show_record(record: dict) -> pd.DataFrame:
    """An environment record as a two-column table."""
    flat = {k: (json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in record.items()}
    return pd.DataFrame({"value": flat})


def model_card(lm, cfg: Config) -> pd.DataFrame:
    """Architecture facts that set the KV-cache size, and that size per token."""
    c = lm.model.config
    layers, kv_heads = c.num_hidden_layers, getattr(c, "num_key_value_heads", c.num_attention_heads)
    per_token = 2 * layers * kv_heads * lm.head_dim * 2  # keys and values, fp16
    facts = {
        "model": lm.name,
        "random weights": lm.is_random,
        "parameters": sum(p.numel() for p in lm.model.parameters()),
        "decoder layers": layers,
        "query heads": c.num_attention_heads,
        "KV heads": kv_heads,
        "head dim": lm.head_dim,
        "trained context (tokens)": lm.native_context,
        "allowed context (tokens)": lm.max_context,
        "RoPE scaling": json.dumps(cfg.model.get("rope_scaling")),
        "fp16 KV bytes per token": per_token,
        "fp16 KV MiB at the longest length": round(per_token * max(cfg.niah.lengths) / 2**20, 1),
    }
    return pd.DataFrame({"value": facts})


def source_formats(spec: dict, run: RunDir) -> pd.DataFrame | str:
    """Each decoder tensor's format in the GGUF that a model spec is dequantized from, read from the file
    (:func:`niah.weightquant.source.shipped_formats`) and written to the run folder for its summary; or a sentence
    for a model that is not a GGUF's."""
    found = source.shipped_formats(spec)
    if found is None:
        return f"the {spec['source']} model's weights are not a GGUF's: nothing was dequantized"
    line, table = found
    table.to_csv(run.path / source.SOURCE_FORMATS, index=False)
    print(line)
    return table


def heatmaps(df: pd.DataFrame, cfg: Config, figures_dir: Path) -> list[Path]:
    """One accuracy heatmap per method, with a difference-from-reference panel for the others; saved as PNG and SVG."""
    # heavy: matplotlib and seaborn, for the figures only
    import matplotlib.pyplot as plt

    from .report.plots import needle_heatmap, save

    ref = cfg.niah.reference
    paths = []
    for style in sorted(df["prompt_style"].unique()):
        part = df[df["prompt_style"] == style]
        for method in [m for m in dict.fromkeys([*cfg.niah.methods, *part["method"]]) if m in set(part["method"])]:
            panels = 1 if method == ref else 2
            fig, axes = plt.subplots(1, panels, figsize=(8 * panels, 4.2), squeeze=False)
            needle_heatmap(part, method, axes[0][0], title=f"{method} ({style} prompt), {cfg.name}")
            if panels == 2:
                needle_heatmap(part, method, axes[0][1], diff_from=ref)
            fig.tight_layout()
            paths += save(fig, figures_dir, f"heatmap_{style}_{method}")
            plt.show()
            plt.close(fig)
        paths += _overview(part, cfg, style, figures_dir)
    return paths


def _overview(part: pd.DataFrame, cfg: Config, style: str, figures_dir: Path) -> list[Path]:
    """Every method's accuracy heatmap in one figure, the reference first: ``heatmap_<style>_overview``."""
    # heavy: matplotlib and seaborn, for the figures only
    import matplotlib.pyplot as plt

    from .report.plots import needle_heatmap, save

    ref = cfg.niah.reference
    methods = [m for m in dict.fromkeys([ref, *cfg.niah.methods, *part["method"]]) if m in set(part["method"])]
    cols = min(4, len(methods))
    rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, method in zip(axes.flat, methods):
        needle_heatmap(part, method, ax, title=method)
    for ax in list(axes.flat)[len(methods) :]:
        ax.set_axis_off()
    fig.suptitle(f"needle accuracy by depth and length ({style} prompt), {cfg.name}")
    fig.tight_layout()
    paths = save(fig, figures_dir, f"heatmap_{style}_overview")
    plt.show()
    plt.close(fig)
    return paths


def ablation(df: pd.DataFrame, cfg: Config, lm, figures_dir: Path) -> pd.DataFrame:
    """Issue 41's ablation: every method asked at the battery's longest length against the reference, with its bits
    per value on the coded layers (:func:`~niah.report.tables.ablation_table`), and its figure, saved as PNG and
    SVG."""
    # heavy: matplotlib and seaborn, for the figures only
    import matplotlib.pyplot as plt

    from .report.plots import ablation as ablation_figure
    from .report.plots import save
    from .report.tables import ablation_table

    length, c = max(cfg.battery.lengths), lm.model.config
    table = ablation_table(df, cfg.niah.reference, length, c.num_key_value_heads, lm.head_dim)
    if not len(table):  # nothing paired at that length: no figure to draw
        print(f"no method answered at {length} tokens beside {cfg.niah.reference}: no ablation to draw")
        return table
    fig = ablation_figure(table, float(table["ref_accuracy"].max()), length)  # the reference on the paired questions
    save(fig, figures_dir, f"kv_ablation_{length}")
    plt.show()
    plt.close(fig)
    return table


def ask_one(cfg: Config, lm, rows: pd.DataFrame, methods=("fp16", "q4_0", "turboquant_k8v4@engine")) -> pd.DataFrame:
    """The battery's first question at its shortest length asked through :func:`niah.ask.ask_ids` (what a user runs on
    their own document), next to the battery's own rows for it (``rows``: the needle table) where it has them."""
    # heavy: the battery and the ask path load transformers' generation code, for this cell only
    from .ask import ask_ids
    from .experiments.battery import question_prompts

    if not cfg.battery.present:
        return pd.DataFrame({"note": ["this config has no battery: see the README's section on your own model"]})
    ids, q = next(p for p in question_prompts(cfg, lm) if p[1].length == cfg.battery.lengths[0])
    n = cfg.niah
    table = ask_ids(
        lm.model, lm.tokenizer, ids, list(q.question_ids), list(methods), list(q.answer_ids), [q.value],
        max_new_tokens=n.max_new_tokens, engine_chunk=n.engine_chunk, prefill_chunk=n.prefill_chunk,
    )  # fmt: skip
    mine = rows[(rows.get("needle_key") == q.key) & (rows["length"] == q.length) & (rows["status"] == "ok")]
    battery = mine.set_index("method")[["generated", "answer_logprob"]].add_prefix("battery_")
    return table[["answer", "score", "answer_logprob", "kl_first_token", "kv_bytes"]].join(battery)


def perplexity_breakdown(cfg: Config, table: pd.DataFrame, figures_dir: Path) -> list[Path]:
    """The loss-breakdown figure of :func:`~niah.report.tables.perplexity_table`'s ``table`` (keys, values,
    full and sliding layers alone), when the config asks for ``kv_perplexity.breakdown``; saved as PNG and SVG."""
    # heavy: matplotlib and seaborn, for the figures only
    import matplotlib.pyplot as plt

    from .report.plots import loss_breakdown, save

    parts = cfg.kv_perplexity.parts
    if not parts:
        return []
    fig = loss_breakdown(table, parts)
    paths = save(fig, figures_dir, "kv_perplexity_breakdown")
    plt.show()
    plt.close(fig)
    return paths


def companions(cfg: Config, run: RunDir) -> list[dict]:
    """Issue 42: each config of ``cfg.companions`` (another architecture) asks its battery and, where it has a
    ``kv_perplexity`` section, its perplexity through the cache, into ``<this run folder's parent>/<its name>/``
    (resumable, as every table).  Per companion: ``config`` (its name), ``paired`` (its battery against its
    reference, :func:`~niah.report.stats.paired_table`) and ``perplexity`` (empty without that section)."""
    # heavy: transformers, for the cells that run a model only
    from .experiments.battery import run_needles
    from .experiments.kvppl import run_kv_perplexity
    from .report.stats import paired_table
    from .report.tables import perplexity_table

    out = []
    for other in companion_configs(cfg):
        folder = RunDir(other, run.path.parent / other.name)
        folder.path.mkdir(parents=True, exist_ok=True)
        save_json(env.environment_record(), folder.path / "environment.json")  # the machine, for its summary
        lm = load(other)
        run_needles(other, lm, folder.file("needles"))
        ppl = pd.DataFrame()
        if other.kv_perplexity.present:
            run_kv_perplexity(other, lm, folder.file("kv_perplexity"))
            ppl = perplexity_table(folder.rows("kv_perplexity"), other.niah.reference)
        out.append(
            {
                "config": other.name,
                "paired": paired_table(folder.rows("needles"), other.niah.reference),
                "perplexity": ppl,
            }
        )
    return out


def cold_warm(cfg: Config, run: RunDir) -> pd.DataFrame | str:
    """Run (once per sweep settings) and show the cold/warm first-request TTFT probe that ``sweep.cold_warm`` asks
    for."""
    from .experiments.sweep import cold_vs_warm  # heavy: transformers, for notebook 04 only

    spec = cfg.sweep.cold_warm
    if not spec:
        return "not measured: this config sets no sweep.cold_warm {target, warmup}"
    runs = json.loads(run.cold_warm.read_text()) if run.cold_warm.exists() else {}
    if runs.get("settings_hash") != settings_hash(cfg, "sweep"):
        runs = {
            **cold_vs_warm(cfg, spec["target"], spec["warmup"], spec.get("repeats", 1)),
            "settings_hash": settings_hash(cfg, "sweep"),
        }
        save_json(runs, run.cold_warm)
    return (
        pd.DataFrame({"cold_s": runs["cold_s"], "warm_s": runs["warm_s"]})
        .describe()
        .loc[["count", "50%", "min", "max"]]
        .assign(reduction_of_medians=runs["reduction"], target=runs["target"], warmup=runs["warmup"])
    )


def claims_ledger(cfg: Config, run: RunDir) -> pd.DataFrame:
    """Gather this run's evidence, compute every verdict, and save the ledger as CSV and Markdown."""
    lm = load(cfg)
    table = ledger(gather_evidence(run, kv_value_share(lm, cfg)))
    table.to_csv(run.ledger.with_suffix(".csv"), index=False)
    run.ledger.write_text(table[["id", "claim", "measured", "verdict"]].to_markdown(index=False))
    return table
