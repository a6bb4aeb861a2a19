import json

import pytest

from niah.experiments.scoring import answer_ended, string_match_all
from niah.report.stats import wilson_interval
from niah.results import ResultsTable, read_rows


def test_string_match_all():
    assert string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert string_match_all("abc and XYZ", ["abc", "xyz", "nope"]) == pytest.approx(2 / 3)
    assert string_match_all("", ["1"]) == 0.0
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_wilson_interval():
    lo, hi = wilson_interval(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95  # the textbook 8/10 interval: [0.490, 0.943]
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for n in range(1, 300):  # the interval always holds the proportion (at n = 100, 1.0 once rounded to 0.99999...)
        for k in (0, n // 3, n):
            lo, hi = wilson_interval(k, n)
            assert lo <= k / n <= hi


def test_table_skips_duplicates_and_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "r.jsonl"
    t = ResultsTable(path, ("a",))
    t.append({"a": 1, "v": "x"})
    t.append({"a": 1, "v": "again"})
    with open(path, "a") as f:
        f.write('{"a": 2, "v": "tor')  # a kill in the middle of a write
    with pytest.warns(UserWarning, match="incomplete"):
        assert [r["a"] for r in read_rows(path)] == [1]
    t2 = ResultsTable(path, ("a",))
    t2.append({"a": 2, "v": "y"})
    assert [r["a"] for r in read_rows(path)] == [1, 2]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_an_answer_ends_at_a_newline_after_its_content_not_at_leading_blank_lines():
    assert not answer_ended("\n\n    150") and not answer_ended(" 15") and not answer_ended("")
    assert answer_ended("\n\n    1502111.\n") and answer_ended(": 1502111.\n\n")
