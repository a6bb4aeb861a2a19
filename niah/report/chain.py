"""The notebook chain: run it with papermill for a config, and export it as one HTML report."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import warnings
from pathlib import Path

from ..config import ROOT, companion_configs, load_config
from ..results import hold_lock
from .claims import CLAIMS
from .htmlcheck import PRINT_STYLE, check_report
from .summary import NoResults, summary_markdown

NOTEBOOKS = ROOT / "notebooks"


def chain() -> list[Path]:
    """The numbered notebooks, in order."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def run_dir(config: str, run_root: Path | None = None) -> Path:
    """The run folder of ``config`` (a name from ``configs/`` or a YAML path): ``papermill_runs/<its name:>``."""
    return (run_root or ROOT / "papermill_runs") / load_config(config).name


def reproduce(
    config: str, only: list[str] | None = None, run_root: Path | None = None, figures_root: Path | None = None
) -> dict:
    """Execute every notebook (or those whose names start with ``only``) for ``config``; return wall times
    (also written to ``timing.json``, or ``timing_partial.json`` for an ``only`` run).  A full run that resumes
    interrupted ones adds their seconds (``interrupted_runs_s``, ``total_with_interrupted``).

    Executed notebooks and results go to ``papermill_runs/<config>/``, figures to ``figures/<config>/``
    (or under ``run_root`` and ``figures_root``).
    """
    cfg = load_config(config)  # fails fast on a bad config, before any notebook starts
    companion_configs(cfg)  # and on a bad companion, which notebook 03 would meet only after 00-02
    unknown = [o for o in only or [] if not any(nb.name.startswith(o) for nb in chain())]
    if unknown:
        raise FileNotFoundError(
            f"no notebook starts with {', '.join(map(repr, unknown))}: "
            f"choose among {', '.join(nb.name[:2] for nb in chain())}"
        )
    name = cfg.name
    out = (run_root or ROOT / "papermill_runs") / name
    hold_lock(out, f"run folder {out}")
    out.mkdir(parents=True, exist_ok=True)
    params = {"config": config, "run_dir": str(out), "figures_dir": str((figures_root or ROOT / "figures") / name)}
    interrupted = [] if only else _interrupted_runs(out)
    target = out / ("timing_partial.json" if only else "timing.json")  # a partial rerun never overwrites the chain's
    before = json.loads(target.read_text()) if only and target.exists() else {}
    times, run = {}, {}
    for nb in chain():
        if only and not any(nb.name.startswith(o) for o in only):
            continue
        print(f"[reproduce {config}] {nb.name}", flush=True)
        t0 = time.perf_counter()
        _execute(nb, out / nb.name, params)
        run[nb.name] = round(time.perf_counter() - t0, 1)
        times = _timing(run, before, interrupted)
        if only:  # written after each notebook, so a later notebook's failure keeps the times of those that ran
            target.write_text(json.dumps(times, indent=1))
    if not only:  # a full chain's timing.json is written once it has run to the end
        target.write_text(json.dumps(times, indent=1))
        (out / ATTEMPT).unlink(missing_ok=True)
        try:
            (out / "summary.md").write_text(summary_markdown(cfg, out), encoding="utf-8")
        except NoResults as err:
            print(f"[reproduce {config}] no summary.md: {err}", flush=True)
    print(f"[reproduce {config}] done in {times['total']} s; executed notebooks in {out}", flush=True)
    return times


def _timing(run: dict, before: dict, interrupted: list[float]) -> dict:
    """The timing record of this run's notebook seconds ``run``: on top of ``before`` (the partial runs' record so
    far; a notebook run again keeps its earlier times apart) and after the ``interrupted`` runs it resumed."""
    earlier = dict(before.get("earlier_runs_s", {}))
    for name in set(run) & set(before):  # run again: resuming its rows, or redoing them after a change
        earlier[name] = [*earlier.get(name, []), before[name]]
    times = {**{k: v for k, v in before.items() if k.endswith(".ipynb")}, **run}
    times["total"] = round(sum(times.values()), 1)
    if earlier:  # what the notebooks cost in all: their earlier runs, then the latest ones
        times |= {
            "earlier_runs_s": earlier,
            "total_with_earlier": round(times["total"] + sum(sum(v) for v in earlier.values()), 1),
        }
    if interrupted:  # what the chain cost in all: the runs that were cut off, then resumed by this one
        times |= {
            "interrupted_runs_s": interrupted,
            "total_with_interrupted": round(times["total"] + sum(interrupted), 1),
        }
    return times


def _execute(nb: Path, target: Path, params: dict) -> None:
    """Execute notebook ``nb`` into ``target`` with papermill, on a kernel of its own (:func:`_kernel`).

    On a Ctrl-C (a KeyboardInterrupt: it reaches this process only, a kernel runs in a session of its own) the kernel
    is killed at once, with the processes it started, and the interrupt goes on.  Nothing more is printed and no
    kernel is left running; the rows the notebook wrote stay (each is on disk when its append returns).
    """
    import papermill  # optional extra: notebooks
    from jupyter_core.utils import run_sync  # optional extra: notebooks

    kernel = _kernel()
    interrupted = False
    try:
        papermill.execute_notebook(
            str(nb), str(target), parameters=params, cwd=str(NOTEBOOKS), progress_bar=False, log_output=True, km=kernel
        )
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        run_sync(kernel.stop)(interrupted)


def _kernel():
    """A kernel manager to hand papermill, of the ``python3`` kernel (which every notebook names).  nbclient starts
    the kernel and opens a client to it but, the manager not being its own, stops neither: ``await stop(interrupted)``
    does, and so it runs before anything else touches the kernel after a Ctrl-C (nbclient's own stop would interrupt
    the kernel, then ask it to shut down)."""
    from jupyter_client import AsyncKernelManager  # optional extra: notebooks

    class Kernel(AsyncKernelManager):
        opened = None  # the client nbclient talks to the kernel with

        def client(self, **kwargs):
            self.opened = super().client(**kwargs)
            return self.opened

        async def stop(self, interrupted: bool) -> None:
            """Shut the kernel down (killed if ``interrupted``), free its ports and files, close the client."""
            if interrupted:
                # nbclient's wait for the cell (or the start) that the Ctrl-C cut off is still on this loop: cancelled
                # and collected before the kernel dies, it never finds the kernel dead, which it would log, and then
                # fail with a DeadKernelError whose traceback asyncio prints when the task is garbage-collected
                cut_off = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
                for task in cut_off:
                    task.cancel()
                await asyncio.gather(*cut_off, return_exceptions=True)  # a cancelled wait raises DeadKernelError too
                if self.has_kernel:
                    # killed, not interrupted then asked to shut down: ipykernel would reply to the interrupted cell on
                    # a socket the shutdown request has closed, and print the ZMQError's traceback
                    await self.signal_kernel(signal.SIGKILL)  # to its process group: the processes it started too
                    await self.finish_shutdown()  # waits for it to die, and reaps it
            elif await self.is_alive():  # it ran its notebook to the end, or to a failed cell
                await self.shutdown_kernel()
            await self.cleanup_resources()
            if self.opened is not None:
                self.opened.stop_channels()

    return Kernel()


ATTEMPT = "timing_attempt.json"  # a full chain run in progress: when it started, and the interrupted runs before it


def _interrupted_runs(out: Path) -> list[float]:
    """Seconds spent by earlier full runs of this folder that never finished (a kill, a crash, Ctrl-C), each
    from its start to the last write of a notebook it executed; records this run's start in :data:`ATTEMPT`."""
    attempt, runs = out / ATTEMPT, []
    if attempt.exists():
        try:
            earlier = json.loads(attempt.read_text())
            last = max(
                [attempt.stat().st_mtime]
                + [(out / nb.name).stat().st_mtime for nb in chain() if (out / nb.name).exists()]
            )
            runs = [*earlier.get("interrupted_runs_s", []), round(max(0.0, last - earlier["started"]), 1)]
        except (ValueError, KeyError, OSError):
            runs = []  # an unreadable record: the wall time covers this run only
    attempt.write_text(json.dumps({"started": time.time(), "interrupted_runs_s": runs}))
    return runs


def report(config: str, run_root: Path | None = None) -> Path:
    """Merge the executed notebooks of ``config`` into one self-contained HTML file (code hidden, images embedded)."""
    # optional extra: notebooks
    import nbformat
    from nbconvert import HTMLExporter

    out = run_dir(config, run_root)
    executed = [out / nb.name for nb in chain() if (out / nb.name).exists()]
    if not executed:
        raise FileNotFoundError(f"no executed notebooks in {out}: run `make reproduce CONFIG={config}` first")
    notebooks = {path: nbformat.read(path, as_version=4) for path in executed}
    gaps = [f"{nb.name} was not executed" for nb in chain() if not (out / nb.name).exists()]
    gaps += [f"{path.name} {why}" for path, nb in notebooks.items() if (why := _unfinished(nb))]
    merged = nbformat.v4.new_notebook()
    merged.metadata = notebooks[executed[0]].metadata
    merged.metadata["title"] = f"Needle retrieval under KV and weight quantization: config {config}"
    if gaps:
        warnings.warn(f"the report of {config} is incomplete: {'; '.join(gaps)}", stacklevel=2)
        banner = (
            "**This report is incomplete.** "
            + "; ".join(gaps)
            + f". Rerun `make reproduce CONFIG={config}` to finish the chain."
        )
        merged.cells.append(nbformat.v4.new_markdown_cell(banner))
    for nb in notebooks.values():
        merged.cells.extend(_without_progress_bars(c) for c in nb.cells)
    exporter = HTMLExporter(exclude_input=True, embed_images=True)
    html, _ = exporter.from_notebook_node(merged)
    html = html.replace("</head>", PRINT_STYLE + "</head>", 1)
    target = out / "report.html"
    tmp = target.with_suffix(".partial")
    tmp.write_text(html, encoding="utf-8")
    tmp.rename(target)
    return target


def _unfinished(nb) -> str:
    """Why an executed notebook did not run to its end (papermill's cell status, or an error output); "" if it did."""
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        status = cell.metadata.get("papermill", {}).get("status", "completed")
        if status != "completed" or any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            return f"stopped at code cell {i + 1} ({'an error' if status in ('completed', 'failed') else status})"
    return ""


_PROGRESS = re.compile(r"\d+%\||IProgress not found|from \.autonotebook import")  # tqdm bars and their notebook warning


def _without_progress_bars(cell):
    """``cell`` with progress-bar lines removed from its stderr streams (other stderr lines, warnings, stay)."""
    outputs = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream" and o.get("name") == "stderr":
            kept = "".join(line for line in o["text"].splitlines(keepends=True) if not _PROGRESS.search(line))
            if not kept.strip():
                continue
            o["text"] = kept
        outputs.append(o)
    if "outputs" in cell:
        cell["outputs"] = outputs
    return cell


def check(config: str, run_root: Path | None = None) -> dict:
    """Render ``report.html`` of ``config`` in headless Chromium (:mod:`niah.report.htmlcheck`): every figure of the
    executed notebooks must decode, and the claims ledger table must list every claim with a verdict."""
    import nbformat  # optional extra: notebooks

    out = run_dir(config, run_root)
    target = out / "report.html"
    if not target.exists():
        raise FileNotFoundError(f"no report in {out}: run `make report CONFIG={config}` first")
    figures = sum(
        "image/png" in o.get("data", {})
        for nb in chain()
        if (out / nb.name).exists()
        for c in nbformat.read(out / nb.name, as_version=4).cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
    )
    floor = len(load_config(config).niah.methods)  # at least one needle heatmap per KV method
    return check_report(target, [c.id for c in CLAIMS], max(figures, floor))
