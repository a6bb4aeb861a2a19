"""No behaviour change: ``python -m niah run --config smoke`` gives the rows it gave before the code was reorganised.

``golden/smoke_run.jsonl`` holds the 32 rows of that run at commit 2fcb3a1 (before issue 40's refactor), without
timings and provenance (time, commit, worker, library versions).  Strings, integers, hashes and statuses must be
equal; measured floats equal to within 1e-5 (relative), so that a refactor may reorder a sum but not change a result.
A deliberate change of the numbers or of a settings hash updates this file in the same commit, and says why.
"""

import json
import math
from pathlib import Path

from niah.experiments.battery import run_needles

GOLDEN = Path(__file__).parent / "golden" / "smoke_run.jsonl"
KEY = ("method", "length", "context", "trial")


def _rows(path) -> dict[tuple, dict]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return {tuple(r[k] for k in KEY): r for r in rows}


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)
    return a == b


def test_the_smoke_run_gives_the_golden_rows(smoke_cfg, tiny, tmp_path):
    golden = _rows(GOLDEN)
    now = _rows(run_needles(smoke_cfg, tiny, tmp_path / "r.jsonl", progress=False))
    assert now.keys() == golden.keys()
    diffs = [
        (k, f, golden[k][f], now[k].get(f)) for k in golden for f in golden[k] if not _same(golden[k][f], now[k].get(f))
    ]
    assert not diffs, f"{len(diffs)} fields differ from the golden run, e.g. {diffs[:3]}"
