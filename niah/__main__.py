"""Command line: ``python -m niah {run,ask,reproduce,report,report-check,summary,repair,bench,env}``; see
``python -m niah -h``."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from .kv.layout import UnsupportedLayout
from .report.htmlcheck import ReportCheckError
from .results import ResultsCorrupt, TableLocked, move_tail_aside

if TYPE_CHECKING:  # the CLI imports torch-heavy modules only for the command it runs
    from .config import Config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="niah", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "run", help="run (or resume) a config's needle questions (its battery, else its grid) without Jupyter"
    )
    p.add_argument("--config", default="cpu")
    p.add_argument("--methods", nargs="+", help="override the methods of the battery (or of niah: where there is none)")
    p.add_argument("--lengths", nargs="+", type=int, help="override the lengths of the battery (or of niah)")
    p.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="run the battery on Ray: local, auto or ray://host:10001 (pip install -e '.[ray]')",
    )
    p = sub.add_parser("ask", help="ask one question about a text file through KV methods, paired with fp16")
    p.add_argument("--config", default="cpu", help="the config whose model answers")
    p.add_argument("--methods", nargs="+", default=["fp16"], help="KV methods (fp16 is always asked, first)")
    p.add_argument("--context-file", required=True, help="a UTF-8 text file: the context")
    p.add_argument("--question", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p = sub.add_parser("reproduce", help="execute the notebook chain with papermill")
    p.add_argument("--config", default="cpu")
    p.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 00 03")
    p.add_argument("--cluster", metavar="ADDRESS", help="notebook 03's battery on Ray: local, auto or ray://host:10001")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the config's whole chain on the CPU with a tiny random model of its architecture",
    )
    p = sub.add_parser("gpu-check", help="the sweep of random Qwen3.5-35B-A3B at 4K and 16K on a GPU (make gpu-check)")
    p.add_argument(
        "--dry-run", action="store_true", help="the same script on the CPU with a tiny model of the architecture"
    )
    p = sub.add_parser("report", help="export the executed chain as one HTML report")
    p.add_argument("--config", default="cpu")
    p = sub.add_parser(
        "report-check", help="render the HTML report in headless Chromium and check its figures and ledger"
    )
    p.add_argument("--config", default="cpu")
    p = sub.add_parser(
        "autoround-default",
        help="W4A16 AutoRound at the source's blocks with auto-round's 200 iterations on every block, measured once "
        "into the config's run folder (make autoround-200)",
    )
    p.add_argument("--config", default="cpu")
    sub.add_parser("env", help="print the environment record")
    p = sub.add_parser("summary", help="print a run's headline results as Markdown")
    p.add_argument("--config", default="cpu")
    p.add_argument(
        "--write", action="store_true", help="write results/<name>/summary.md and the README's results block"
    )
    p = sub.add_parser("repair", help="keep the intact rows of a damaged results file and move the rest aside")
    p.add_argument("path")
    p = sub.add_parser("bench", help="speed benchmarks, printed as ratios measured in one run")
    p.add_argument(
        "what",
        choices=["kv", "cluster"],
        help="kv: KV codecs, decode attention, transformers' QuantizedCache; cluster: the Ray path's ratios",
    )
    p.add_argument("--methods", nargs="*", help="KV methods (default: every registered one)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hf-context", type=int, default=2048, help="context of the QuantizedCache comparison (0: skip it)")
    args = ap.parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"niah: warning: {message}\n"  # one line, no source echo

    # heavy: config and models load torch, so `niah -h` and a usage error answer without them
    from .cluster import ClusterError
    from .config import CLUSTER_ENV, ConfigError, load_config
    from .models import ModelUnavailable, load_model

    if getattr(args, "dry_run", False) and getattr(args, "cluster", None):
        print("niah: error: a dry run runs in one process: drop --cluster (or --dry-run)", file=sys.stderr)
        return 2
    if getattr(args, "cluster", None):
        os.environ[CLUSTER_ENV] = args.cluster  # read by load_config here and in the notebooks' kernels
    try:
        if args.cmd == "run":
            from .experiments.battery import run_needles  # heavy: transformers, for this command only

            cfg = load_config(args.config)
            if args.methods or args.lengths:
                section = "battery" if cfg.battery.present else "niah"
                over = {k: v for k, v in (("methods", args.methods), ("lengths", args.lengths)) if v}
                cfg = cfg.updated(section, **over)
            _record_environment(cfg)
            path = run_needles(cfg, load_model(cfg.model, device=cfg.device))
            print(f"results: {path}")
            _report_statuses(cfg)
        elif args.cmd == "ask":
            _ask(args)
        elif args.cmd == "reproduce":
            from .report.chain import reproduce  # heavy: each command loads its own stage only

            config = args.config
            if args.dry_run:
                from .dryrun import write_dry_config  # heavy: each command loads its own stage only

                path, left_out = write_dry_config(config)
                print(f"[dry run] {path}" + "".join(f"\n[dry run] left out: {why}" for why in left_out), flush=True)
                config = str(path)
            reproduce(config, args.only)
        elif args.cmd == "gpu-check":
            from .gpucheck import gpu_check  # heavy: each command loads its own stage only

            print(f"gpu check: {gpu_check(args.dry_run)}")
        elif args.cmd == "report":
            from .report.chain import report  # heavy: each command loads its own stage only

            print(f"report: {report(args.config)}")
        elif args.cmd == "report-check":
            from .report.chain import check  # heavy: each command loads its own stage only

            print(json.dumps(check(args.config), indent=1))
        elif args.cmd == "bench":
            _bench_cluster() if args.what == "cluster" else _bench_kv(args)
        elif args.cmd == "autoround-default":
            _autoround_default(args.config)
        elif args.cmd == "summary":
            _summary(args.config, args.write)
        elif args.cmd == "repair":
            tail, kept, moved = move_tail_aside(args.path)
            if tail is None:  # a healthy file: an answer, not an error
                print(f"{args.path} has no damaged line ({kept} rows): nothing to repair")
            else:
                print(f"kept {kept} rows in {args.path}; moved {moved} lines from the damaged one onwards to {tail}")
        elif args.cmd == "env":
            from .env import environment_record  # heavy: each command loads its own stage only

            print(json.dumps(environment_record(), indent=1))
    except (
        ConfigError,
        ModelUnavailable,
        UnsupportedLayout,
        FileNotFoundError,
        ReportCheckError,
        ResultsCorrupt,
        TableLocked,
        ClusterError,
    ) as err:
        print(f"niah: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\nniah: interrupted. Every row written so far is kept: run the same command again to resume.",
            file=sys.stderr,
        )
        return 130
    except OSError as err:  # a full disk, a read-only or unwritable folder: one line, never a traceback
        print(f"niah: error: {_os_problem(err)}", file=sys.stderr)
        return 2
    except Exception as err:
        try:
            from papermill.exceptions import PapermillExecutionError  # optional extra: notebooks
        except ImportError:
            raise err from None
        if not isinstance(err, PapermillExecutionError):
            raise
        print(f"niah: error: a notebook failed at cell {err.exec_count}: {err.ename}: {err.evalue}", file=sys.stderr)
        print(
            "niah: the executed notebook, up to that cell, is in the run folder; rows written are kept", file=sys.stderr
        )
        return 1
    return 0


def _os_problem(err: OSError) -> str:
    """One sentence for a file-system fault: what, where, and the fix."""
    fixes = {
        errno.ENOSPC: "the disk is full: free some space",
        errno.EDQUOT: "the disk quota is used up: free some space",
        errno.EROFS: "the file system is read-only: run where the run folder (papermill_runs/) can be written",
        errno.EACCES: "permission denied: make the folder writable, or run elsewhere",
        errno.EPERM: "permission denied: make the folder writable, or run elsewhere",
    }
    where = f" ({err.filename})" if err.filename else ""
    if err.errno not in fixes:
        return f"{err.strerror or err}{where}"
    return f"{fixes[err.errno]}{where}. Rows written before it are kept: rerun the same command to resume"


def _autoround_default(config: str) -> None:
    """``niah autoround-default``: measure :func:`~niah.weightquant.schemes.autoround_default` (resumable: a
    finished row is not measured again) and print its row."""
    # heavy: each command loads its own stage only
    import time

    from .config import load_config
    from .env import use_threads
    from .models import load_model
    from .rundir import RunDir
    from .weightquant.study import Study
    from .weightquant.tables import view

    cfg = load_config(config)
    use_threads(cfg.threads)
    t0 = time.perf_counter()
    study = Study(cfg, load_model(cfg.weights, device=cfg.device), RunDir(cfg).path)
    rows = study.autoround_default(run=True)
    print(view(rows).to_markdown(index=False))
    print(f"{time.perf_counter() - t0:.0f} s; the row is in {study.table.path}")


def _ask(args) -> None:
    """``niah ask``: the question through each method on the config's model, printed as a table."""
    # heavy: each command loads its own stage only
    from .ask import ask
    from .config import ConfigError, load_config
    from .models import load_model

    try:
        context = Path(args.context_file).read_text(encoding="utf-8")  # closed when read
    except UnicodeDecodeError:
        raise ConfigError(f"{args.context_file} is not UTF-8 text: re-save it as UTF-8") from None
    cfg = load_config(args.config)
    lm = load_model(cfg.model, device=cfg.device)
    try:
        table = ask(lm.model, lm.tokenizer, context, args.question, args.methods, max_new_tokens=args.max_new_tokens)
    except ValueError as err:  # an empty file, an unknown method, a context longer than the model
        raise ConfigError(str(err)) from None
    attrs = table.attrs
    print(f"{lm.name}, {attrs['context_tokens']} context tokens; fp16's answer: {attrs['reference_answer']!r}")
    print(table.to_string(float_format=lambda x: f"{x:.4g}"))


def _record_environment(cfg: Config) -> None:
    """Write the machine's record into the config's run folder, as notebook 00 does (``summary`` names the machine
    from it)."""
    # heavy: torch, for the commands that run a model only
    from .env import environment_record
    from .notebook import save_json
    from .rundir import RunDir

    folder = RunDir(cfg).path
    folder.mkdir(parents=True, exist_ok=True)
    save_json(environment_record(), folder / "environment.json")


def _report_statuses(cfg: Config) -> None:
    """Say on the terminal how the needle rows of ``cfg`` ended; when none is ``ok``, why (with the first reason)."""
    from .rundir import RunDir  # heavy: torch, for the commands that run a model only

    rows = RunDir(cfg).rows("needles")
    counts = rows["status"].value_counts().to_dict() if len(rows) else {}
    print("rows: " + (", ".join(f"{n} {s}" for s, n in counts.items()) or "none"))
    if len(rows) and not counts.get("ok"):
        print(
            f"niah: warning: no row was scored; every one is {' or '.join(counts)}: {rows['reason'].iloc[0]}",
            file=sys.stderr,
        )


def _summary(config: str, write: bool) -> None:
    # heavy: each command loads its own stage only
    from .config import ROOT, load_config
    from .report.summary import README_CONFIG, summary_markdown, write_results

    cfg = load_config(config)
    if write and cfg.name != README_CONFIG:  # the README's block shows the default chain; other configs link theirs
        print(f"wrote {write_results(cfg, None, ROOT / 'results')} (the README's results block shows {README_CONFIG})")
    elif write:
        print(f"wrote {write_results(cfg, ROOT / 'README.md', ROOT / 'results')} and the README's results block")
    else:
        print(summary_markdown(cfg))


def _bench_kv(args) -> None:
    # heavy: each command loads its own stage only
    import torch

    from .config import load_config
    from .data.haystack import haystack_text, tokenize_haystack
    from .experiments import bench
    from .kv.registry import available
    from .models import load_model

    torch.set_num_threads(args.threads)
    methods = args.methods or [m for m in available() if m != "fp16"]
    print(
        f"# KV codecs on a (1, 3, {args.tokens}, 64) fp32 tensor, {args.threads} thread(s); "
        "ratios to a plain copy in this run"
    )
    print(bench.codec_throughput(methods, args.tokens).round(3).to_string(index=False))
    print(f"\n# one decode step's attention over {args.tokens} cached tokens (3 KV heads, 9 query heads, d=64)")
    print(bench.decode_attention(methods, args.tokens).round(3).to_string(index=False))
    if args.hf_context:
        lm = load_model(load_config("cpu").model)
        ids = tokenize_haystack(haystack_text("pydoc"), lm.tokenizer, args.hf_context).ids[: args.hf_context]
        print(f"\n# transformers' caches on {lm.name}, {args.hf_context}-token context, decode ms/token")
        print(bench.hf_quantized_cache(lm, ids).round(2).to_string(index=False))


def _bench_cluster() -> None:
    from .experiments import clusterbench  # heavy: each command loads its own stage only

    print("# 2 Ray workers x 1 thread against 1 process x 2 threads (model loads in the workers included)")
    print(json.dumps(clusterbench.workers_vs_threads(), indent=1))
    print("# scheduling overhead per unit: empty units on 2 warm workers, against a smoke battery unit in one process")
    print(json.dumps(clusterbench.unit_overhead(), indent=1))


if __name__ == "__main__":
    sys.exit(main())
