"""Guards the committed figures: every PNG tracked under ``figures/<config>/`` must be one that a current run of that
config writes.  The names a run can write are read statically (``ast``) from every ``save(fig, folder, name)`` call
in the notebooks' code cells and in ``niah/``; a figure matching none of them, or whose placeholder (a method, a
prompt style, a length) is not one the config asks for, is stale: left from an older run, and now misleading.
It checks names only: a figure whose name a current run still writes, drawn by an older run, passes until the chain
runs again (the README says which committed results predate their config)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

from niah.config import load_config

ROOT = Path(__file__).resolve().parent.parent
# save calls that exist today: the collector must find at least these, so the test cannot pass on an empty set
KNOWN = {
    "f'heatmap_{style}_{method}'",
    "f'heatmap_{style}_overview'",
    "f'kv_ablation_{length}'",
    "'kv_perplexity_breakdown'",
    "f'weightquant_01_weights_x_kv_{L}'",
}


def name_regex(node: ast.expr, fill=lambda src: ".+?") -> str:
    """An anchored-by-fullmatch regex of a figure-name template (a str constant or an f-string): constant parts
    escaped, each formatted value a named group (its source text, non-word characters as ``_``) of ``fill(src)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if not isinstance(node, ast.JoinedStr):
        raise TypeError(f"not a str constant nor an f-string: {ast.unparse(node)}")
    out, seen = [], set()
    for part in node.values:
        if isinstance(part, ast.Constant):
            out.append(re.escape(part.value))
            continue
        src = ast.unparse(part.value)
        key = re.sub(r"\W", "_", src)
        out.append(f"(?P={key})" if key in seen else f"(?P<{key}>{fill(src)})")
        seen.add(key)
    return "".join(out)


def placeholders(node: ast.expr) -> list[str]:
    return [ast.unparse(p.value) for p in getattr(node, "values", []) if isinstance(p, ast.FormattedValue)]


def _save_names(tree: ast.AST, where: str, found: dict, bad: list) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) != "save":
            continue
        name = node.args[2] if len(node.args) >= 3 else next((k.value for k in node.keywords if k.arg == "name"), None)
        if name is None:
            continue  # np.save(file, array) and the like: not a figure
        if isinstance(name, ast.JoinedStr) or (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            found[ast.unparse(name)] = name
        else:
            bad.append(f"{where}:{node.lineno}: save(..., {ast.unparse(name)})")


def templates() -> dict[str, ast.expr]:
    """Every figure-name template of a ``save`` call, by its source text; fails on a name of another kind."""
    found, bad = {}, []
    for nb in sorted(ROOT.glob("notebooks/*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a magic (%time, !cmd): no save call the test can read
                continue
            _save_names(tree, f"{nb.relative_to(ROOT)} cell {i}", found, bad)
    for py in sorted((ROOT / "niah").rglob("*.py")):
        _save_names(ast.parse(py.read_text()), str(py.relative_to(ROOT)), found, bad)
    assert not bad, "save calls whose figure name is neither a str constant nor an f-string:\n" + "\n".join(bad)
    return found


def allowed(cfg) -> dict[str, tuple[str, list]]:
    """What each placeholder may be for ``cfg``: (where it comes from, its values), as the code that saves it."""
    battery = cfg.battery.present  # notebook 03's df is run_needles' rows: the battery's if present, else the grid's
    return {
        # niah.notebook.heatmaps: niah.methods and the df's methods, kept only where the df has rows of them
        "method": ("battery.methods", cfg.battery.methods) if battery else ("niah.methods", cfg.niah.methods),
        "style": ("niah.prompt_styles[:1]", cfg.niah.prompt_styles[:1])
        if battery
        else ("niah.prompt_styles", cfg.niah.prompt_styles),
        "length": ("max(battery.lengths)", [max(cfg.battery.lengths)]),  # niah.notebook.ablation
        "L": ("weightquant.needle_lengths", cfg.weightquant.needle_lengths),  # notebook 01's weights x KV heatmaps
    }


def _git_ls(*pathspec: str) -> list[str] | None:
    try:
        run = subprocess.run(["git", "ls-files", "--", *pathspec], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None  # no git, or not a checkout: the files on disk stand in
    return run.stdout.splitlines()


def committed_figures() -> dict[str, list[str]]:
    """{config: its tracked PNGs (paths from the root)} for every figure folder whose config is in configs/."""
    tracked = _git_ls("figures")
    if tracked is None:
        tracked = [str(p.relative_to(ROOT)) for p in ROOT.glob("figures/*/*")]
    names = {Path(p).parts[1] for p in tracked if len(Path(p).parts) > 2}
    return {
        n: sorted(p for p in tracked if re.fullmatch(rf"figures/{re.escape(n)}/[^/]+\.png", p))
        for n in sorted(names)
        if (ROOT / "configs" / f"{n}.yaml").exists()
    }


def stale_reason(stem: str, temps: dict[str, ast.expr], values: dict) -> str | None:
    """None where some template writes ``stem`` with values the config has; else why not."""
    reasons = []
    for shown, node in temps.items():
        fill = lambda src: "|".join(re.escape(str(v)) for v in values[src][1]) or "(?!)"  # noqa: E731
        if re.fullmatch(name_regex(node, fill), stem):
            return None
        m = re.fullmatch(name_regex(node), stem)
        if m:
            got = {src: m.group(re.sub(r"\W", "_", src)) for src in placeholders(node)}
            off = [f"{s}={v!r} is not in {values[s][0]}" for s, v in got.items() if v not in map(str, values[s][1])]
            reasons.append(f"{shown}: {'; '.join(off) or 'values split wrongly'}")
    return " | ".join(reasons) or "no save() template matches its name"


def test_name_regex_of_an_fstring():
    node = ast.parse('f"weightquant_01_weights_x_kv_{L}"', mode="eval").body
    assert name_regex(node) == r"weightquant_01_weights_x_kv_(?P<L>.+?)"
    assert re.fullmatch(name_regex(node), "weightquant_01_weights_x_kv") is None
    assert re.fullmatch(name_regex(node), "weightquant_01_weights_x_kv_4096")["L"] == "4096"
    both = ast.parse('f"heatmap_{style}_{cfg.name}"', mode="eval").body
    assert re.fullmatch(name_regex(both), "heatmap_completion_turbo3_prod").groupdict() == {
        "style": "completion", "cfg_name": "turbo3_prod"}  # fmt: skip
    assert placeholders(both) == ["style", "cfg.name"]


def test_every_committed_figure_is_written_by_a_current_run():
    temps = templates()
    assert KNOWN <= set(temps), f"the collector missed known save calls: {sorted(KNOWN - set(temps))}"
    figures = committed_figures()
    assert figures, "no figures/<config>/ folder with a configs/<config>.yaml: nothing checked"
    stale = []
    for name, pngs in figures.items():
        values = allowed(load_config(name))
        unmapped = {src for node in temps.values() for src in placeholders(node)} - set(values)
        assert not unmapped, f"figure-name placeholders {sorted(unmapped)}: this test needs their mapping in allowed()"
        for png in pngs:
            reason = stale_reason(Path(png).stem, temps, values)
            if reason:
                stale.append(f"{png}: {reason}")
    assert not stale, f"{len(stale)} committed figure(s) no current run writes (delete or regenerate):\n" + "\n".join(
        stale
    )
