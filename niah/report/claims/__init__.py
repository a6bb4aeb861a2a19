"""The claims ledger: one row per claim ID of the seed articles, with a verdict computed from this run's data.

Each claim in ``claims/claims.yaml`` has our paraphrase, its seed and section, how it is tested, and the threshold
that decides the verdict; each article's module (``seed000``, ``seed001``, ``seed003``) binds its claim IDs to their
evaluators in its ``EVALUATORS`` table.  ``evaluate(ev)`` reads the measured tables in :class:`Evidence` (or does the
arithmetic) and returns ``(measured, verdict)``.  Verdicts are ``supported``, ``refuted``, ``partly``,
``inconclusive (<n and interval>)`` or ``untestable here (<reason>)``; nothing is typed in.  On noisy data a verdict
is ``supported`` or ``refuted`` only when the 95% interval lies wholly on one side of the threshold (the rules, and
where the architecture numbers come from: docs/design-notes.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import yaml

from ...config import ROOT
from ...env import git_commit
from . import seed000, seed001, seed003
from .common import Claim, Evidence, _drops, dense_layout
from .seed000 import _llamacpp_note

__all__ = [
    "CLAIMS",
    "CLAIMS_FILE",
    "Claim",
    "Evidence",
    "_drops",
    "_id_key",
    "_llamacpp_note",
    "dense_layout",
    "gather_evidence",
    "ledger",
    "load_claims",
]


CLAIMS_FILE = ROOT / "claims" / "claims.yaml"


def load_claims(path: Path = CLAIMS_FILE) -> list[Claim]:
    """The claims of ``claims/claims.yaml``, each bound to its evaluator by its article's ``EVALUATORS`` table."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    evaluators = {cid: f for m in (seed000, seed001, seed003) for cid, f in m.EVALUATORS.items()}
    claims = []
    for c in doc["claims"]:
        if c["id"] not in evaluators:
            name = c["id"].lower().replace("-", "_")
            where = "an EVALUATORS table of niah/report/claims/"
            raise ValueError(f"{path}: claim {c['id']} has no evaluator {name}() in {where}")
        article = doc["articles"][c["id"].split("-")[0]]["file"]
        evaluate = evaluators.pop(c["id"])
        claims.append(Claim(c["id"], article, str(c["section"]), c["claim"], c["test"], c["threshold"], evaluate))
    if evaluators:
        raise ValueError(f"{path} lacks the claims of evaluators {sorted(f.__name__ for f in evaluators.values())}")
    return claims


CLAIMS = load_claims()


def ledger(ev: Evidence, extra: list[Claim] = ()) -> pd.DataFrame:
    """One row per claim: id, seed, section, claim, test, threshold, measured, verdict, config, commit."""
    rows = []
    for c in [*CLAIMS, *extra]:
        try:
            measured, verdict = c.evaluate(ev)
        except Exception as err:  # a broken evaluator must not hide the others
            measured, verdict = f"evaluation failed: {type(err).__name__}: {err}", "untestable here (evaluation error)"
        rows.append(
            {
                "id": c.id,
                "seed": c.seed,
                "section": c.section,
                "claim": c.claim,
                "test": c.test,
                "threshold": c.threshold,
                "measured": measured,
                "verdict": verdict,
                "config": ev.config,
                "commit": ev.commit,
            }
        )
    df = pd.DataFrame(rows)
    return df.sort_values("id", key=lambda s: s.map(_id_key)).reset_index(drop=True)


def _id_key(cid: str) -> tuple:
    seed, num = re.fullmatch(r"S(\d)-(\d+)", cid).groups()
    return int(seed), int(num)


def gather_evidence(run, kv_value_share: float | None = None) -> Evidence:
    """Read whatever this run measured from the :class:`~niah.rundir.RunDir` ``run`` (missing tables stay empty;
    rows of other settings are left out)."""
    cfg = run.cfg
    return Evidence(
        config=cfg.name,
        device=cfg.device,
        commit=git_commit(),
        niah=run.rows("needles"),
        sweep=run.rows("sweep"),
        weightquant=run.rows("weightquant"),
        kv_ppl=run.rows("kv_perplexity"),
        cold_warm=json.loads(run.cold_warm.read_text()) if run.cold_warm.exists() else None,
        kv_value_share=kv_value_share,
        llamacpp=run.rows("llamacpp"),
    )
