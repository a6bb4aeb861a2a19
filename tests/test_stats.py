"""Paired statistics: McNemar's exact test, the paired bootstrap, the smallest detectable drop, interval
verdicts, and paired_table's pairing of methods question by question."""

import math

import numpy as np
import pandas as pd
import pytest

from niah.report.stats import interval_verdict, mcnemar_exact, min_detectable_drop, paired_bootstrap, paired_table


def test_mcnemar_counts_discordant_pairs_and_gives_the_exact_binomial_p():
    ref, other = [1, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 0, 1]
    assert mcnemar_exact(ref, other) == {"losses": 6, "gains": 1, "p": pytest.approx(2 * 8 / 128)}
    assert mcnemar_exact([1, 0], [1, 0])["p"] == 1.0


def test_min_detectable_drop_is_the_fewest_significant_losses_over_n():
    assert min_detectable_drop(50) == 6 / 50  # 2 * 0.5**6 = 0.031 < 0.05, 2 * 0.5**5 = 0.0625 is not
    assert math.isnan(min_detectable_drop(5))


def test_paired_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    d = np.random.default_rng(1).normal(0.3, 1.0, 200)
    mean, lo, hi = paired_bootstrap(d)
    assert mean == pytest.approx(d.mean()) and lo < mean < hi and 0.1 < hi - lo < 0.4
    assert paired_bootstrap(d) == (mean, lo, hi)
    assert all(math.isnan(x) for x in paired_bootstrap([]))


@pytest.mark.parametrize(
    "low, high, above, expected",
    [
        (0.2, 0.4, True, "supported"),
        (0.2, 0.4, False, "refuted"),
        (-0.4, -0.2, True, "refuted"),
        (-0.4, -0.2, False, "supported"),
        (-0.1, 0.1, True, "inconclusive"),
        (float("nan"), float("nan"), True, "inconclusive"),
    ],
)
def test_interval_verdict_decides_only_when_the_interval_excludes_the_threshold(low, high, above, expected):
    assert interval_verdict(low, high, 0.0, above) == expected


def _rows(method, scores, logprob):
    return [
        {
            "method": method,
            "status": "ok",
            "prompt_style": "plain",
            "length": 1024 * (1 + i % 2),
            "depth": i,
            "trial": 0,
            "score": float(s),
            "answer_logprob": logprob,
        }
        for i, s in enumerate(scores)
    ]


def test_paired_table_pairs_methods_question_by_question():
    df = pd.DataFrame(_rows("fp16", [1] * 10, -1.0) + _rows("q4_0", [0, 0, 0, 0, 1, 1, 1, 1, 1, 1], -3.0))
    table = paired_table(df.sample(frac=1, random_state=0), by=())  # row order does not matter
    q4 = table.set_index("method").loc["q4_0"]
    assert (q4["n"], q4["losses"], q4["gains"], q4["accuracy"], q4["ref_accuracy"]) == (10, 4, 0, 0.6, 1.0)
    assert q4["logprob_diff"] == pytest.approx(-2.0) and q4["p"] == pytest.approx(0.125)
    by_length = paired_table(df).set_index(["method", "length"])
    assert by_length.loc[("q4_0", 1024), "losses"] == 2 and by_length.loc[("q4_0", 2048), "n"] == 5
    unanswered = paired_table(df[~((df["method"] == "fp16") & (df["depth"] < 2))], by=()).set_index("method")
    assert (
        unanswered.loc["q4_0", "n"] == 8 and unanswered.loc["q4_0", "losses"] == 2
    )  # questions fp16 lacks are left out


def test_read_mode_table_pairs_each_engine_read_with_its_strict_read():
    from niah.report.analysis import read_mode_table

    rows = (
        _rows("k3", [0, 0, 1, 1, 1, 1], -3.0) + _rows("k3@engine", [1] * 6, -1.0) + _rows("q4_0@engine", [1] * 6, -1.0)
    )
    df = pd.DataFrame(rows).assign(
        kl_vs_ref=lambda d: d["method"].map({"k3": 0.2, "k3@engine": 0.05, "q4_0@engine": 0.1})
    )
    table = read_mode_table(df).set_index("length")
    assert list(table["method"]) == ["k3", "k3"]  # q4_0 was asked only @engine: no pair
    assert table.loc[1024, "losses/gains"] == "0/1" and (table.loc[1024, "strict"], table.loc[1024, "engine"]) == (
        2 / 3,
        1.0,
    )
    assert table.loc[2048, "log-prob engine - strict"] == pytest.approx(2.0)
    assert (table.loc[2048, "KL strict"], table.loc[2048, "KL engine"]) == pytest.approx((0.2, 0.05))
    assert read_mode_table(df[df["method"] != "k3"]).empty
