"""The notebook chain runs end to end on the smoke config (tiny random model) with papermill."""

import json

import nbformat
import pandas as pd
import pytest

from niah.config import load_config
from niah.report.chain import chain, check, report, reproduce
from niah.report.htmlcheck import ReportCheckError, find_browser
from niah.report.summary import BEGIN, END, write_results


def test_chain_runs_on_smoke_and_notebooks_are_committed_clean(tmp_path):
    for nb in chain():
        cells = nbformat.read(nb, as_version=4).cells
        assert any("parameters" in c.metadata.get("tags", []) for c in cells), f"{nb.name} has no parameters cell"
        assert all(not c.get("outputs") and not c.get("execution_count") for c in cells if c.cell_type == "code"), (
            nb.name
        )
    times = reproduce("smoke", run_root=tmp_path / "runs", figures_root=tmp_path / "figs")
    assert set(times) >= {nb.name for nb in chain()}
    runs = tmp_path / "runs" / "smoke"
    assert json.loads((runs / "environment.json").read_text())["python"]
    assert (runs / "niah_results.jsonl").stat().st_size > 0
    assert list((tmp_path / "figs" / "smoke").glob("heatmap_*.png"))
    assert (tmp_path / "figs" / "smoke" / "heatmap_completion_overview.png").exists()  # every method in one figure
    for (
        nb
    ) in chain():  # a figure cell shows its figure, never the paths it was saved to (this machine's, in every report)
        for c in nbformat.read(runs / nb.name, as_version=4).cells:
            shown = "".join(
                str(o.get("data", {}).get("text/plain", "")) + str(o.get("text", "")) for o in c.get("outputs", [])
            )
            assert str(tmp_path) not in shown and "PosixPath(" not in shown, f"{nb.name}: {shown[:200]}"
    summary = (runs / "summary.md").read_text()
    assert (
        "Needle accuracy" in summary
        and "McNemar" in summary
        and "Claims ledger**: " in summary
        and "supported" in summary
    )
    assert "**Perplexity through the stored cache**" in summary and "| int8_token " in summary
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold numbers\n{END}\nlayout\n")
    write_results(load_config("smoke"), readme, tmp_path / "results", runs)
    assert readme.read_text() == f"intro\n{BEGIN}\n{summary}{END}\nlayout\n"
    assert (tmp_path / "results" / "smoke" / "summary.md").read_text() == summary
    html = report("smoke", run_root=tmp_path / "runs").read_text()
    assert html.count("data:image/png;base64") >= 5  # figures embedded: the file can be mailed alone
    assert "S3-8" in html and "refuted" in html  # the claims ledger is in it
    try:
        find_browser()
    except ReportCheckError as err:
        pytest.skip(f"report rendered in a browser not checked: {err}")
    seen = check("smoke", run_root=tmp_path / "runs")
    assert seen["figures"] >= 5 and (runs / "report.pdf").stat().st_size > 10_000
    (runs / "report.html").write_text(html.replace("S3-8", "S3-X"))  # a ledger that lost a claim must fail
    with pytest.raises(ReportCheckError, match="S3-8"):
        check("smoke", run_root=tmp_path / "runs")
    broken = html.replace('src="data:image/png;base64,', 'src="data:image/png;base64,AAAA', 1)  # one figure corrupted
    assert broken != html
    (runs / "report.html").write_text(broken)
    with pytest.raises(ReportCheckError, match="did not decode"):
        check("smoke", run_root=tmp_path / "runs")


def test_the_report_drops_progress_bars_but_keeps_warnings():
    from niah.report.chain import _without_progress_bars

    bars = "needle grid:  40%|####      | 2/5 [00:01<00:01]\rneedle grid: 100%|##########| 5/5 [00:02<00:00]\n"
    cell = nbformat.v4.new_code_cell(
        outputs=[
            nbformat.v4.new_output("stream", name="stderr", text=bars),
            nbformat.v4.new_output("stream", name="stderr", text=bars + "UserWarning: torch.compile failed\n"),
            nbformat.v4.new_output("stream", name="stdout", text="50%| printed on purpose\n"),
        ]
    )
    out = _without_progress_bars(cell)["outputs"]
    assert [o["text"] for o in out] == ["UserWarning: torch.compile failed\n", "50%| printed on purpose\n"]


def test_a_report_of_a_half_executed_chain_warns_and_says_so_at_the_top(tmp_path):
    names = [nb.name for nb in chain()]
    out = tmp_path / "smoke"
    out.mkdir()

    def executed(status: str, error: bool = False):
        cell = nbformat.v4.new_code_cell("x = 1", metadata={"papermill": {"status": status}})
        if error:
            cell.outputs = [nbformat.v4.new_output("error", ename="RuntimeError", evalue="boom", traceback=[])]
        return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Chapter zero"), cell])

    nbformat.write(executed("completed"), out / names[0])
    nbformat.write(executed("failed", error=True), out / names[1])
    nbformat.write(executed("pending"), out / names[2])
    with pytest.warns(UserWarning, match="incomplete") as seen:
        html = report("smoke", run_root=tmp_path).read_text()
    said = str(seen[0].message)
    assert (
        f"{names[1]} stopped at code cell 1 (an error)" in said
        and f"{names[2]} stopped at code cell 1 (pending)" in said
    )
    assert f"{names[3]} was not executed" in said and names[0] not in said
    assert html.index("This report is incomplete") < html.index("Chapter zero")  # the banner comes first


def test_a_resumed_chain_counts_the_interrupted_run_in_its_wall_time(tmp_path, monkeypatch):
    import time

    calls = []

    def execute(src, dst, **_):
        calls.append(dst)
        time.sleep(0.3)
        nbformat.write(nbformat.v4.new_notebook(), dst)
        if len(calls) == 2:  # the first run is cut off in its second notebook
            raise KeyboardInterrupt

    monkeypatch.setattr("papermill.execute_notebook", execute)
    with pytest.raises(KeyboardInterrupt):
        reproduce("smoke", run_root=tmp_path, figures_root=tmp_path / "figs")
    assert not (tmp_path / "smoke" / "timing.json").exists()
    times = reproduce("smoke", run_root=tmp_path, figures_root=tmp_path / "figs")
    (cut,) = times["interrupted_runs_s"]
    assert 0.5 <= cut < 5 and times["total_with_interrupted"] == pytest.approx(times["total"] + cut, abs=0.11)
    assert json.loads((tmp_path / "smoke" / "timing.json").read_text()) == times
    assert not (tmp_path / "smoke" / "timing_attempt.json").exists()  # the next run starts a fresh count


def test_partial_runs_that_run_a_notebook_again_keep_its_earlier_times(tmp_path, monkeypatch):
    """``--only 00``, then ``--only 00 05`` (a notebook resumed after a code change): the latest time per notebook,
    and the earlier one kept apart in the total the notebooks cost."""
    monkeypatch.setattr(
        "papermill.execute_notebook", lambda src, dst, **_: nbformat.write(nbformat.v4.new_notebook(), dst)
    )
    first = reproduce("smoke", only=["00"], run_root=tmp_path, figures_root=tmp_path / "figs")
    assert set(first) == {"00_environment_check.ipynb", "total"}
    second = reproduce("smoke", only=["00", "05"], run_root=tmp_path, figures_root=tmp_path / "figs")
    assert second["earlier_runs_s"] == {"00_environment_check.ipynb": [first["00_environment_check.ipynb"]]}
    notebooks = {k: v for k, v in second.items() if k.endswith(".ipynb")}
    assert len(notebooks) == 2 and second["total"] == pytest.approx(sum(notebooks.values()), abs=0.11)
    assert second["total_with_earlier"] == pytest.approx(second["total"] + first["total"], abs=0.11)
    from niah.report.summary import _header
    from niah.rundir import RunDir

    ok = pd.DataFrame([{"model": "m", "git_commit": "c", "time": "t"}])
    line = _header(RunDir(load_config("smoke"), tmp_path / "smoke"), ok)
    assert "summed over separate `--only` runs), after earlier runs of the same notebooks (00 " in line
    assert f"{second['total_with_earlier'] / 60:.1f} min in all" in line


def test_a_partial_run_that_fails_keeps_the_times_of_the_notebooks_it_ran(tmp_path, monkeypatch):
    """``--only 00 05`` with 05 failing: 00's time is in ``timing_partial.json`` all the same."""

    def execute(src, dst, **_):
        if "05_" in str(src):
            raise RuntimeError("a plot refused its input")
        nbformat.write(nbformat.v4.new_notebook(), dst)

    monkeypatch.setattr("papermill.execute_notebook", execute)
    with pytest.raises(RuntimeError, match="a plot refused"):
        reproduce("smoke", only=["00", "05"], run_root=tmp_path, figures_root=tmp_path / "figs")
    kept = json.loads((tmp_path / "smoke" / "timing_partial.json").read_text())
    assert set(kept) == {"00_environment_check.ipynb", "total"}
