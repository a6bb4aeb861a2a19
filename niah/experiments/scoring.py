"""Scores: RULER's ``string_match_all``, and when a greedy answer has ended (the Wilson interval of an accuracy is
:func:`niah.report.stats.wilson_interval`)."""

from __future__ import annotations


def string_match_all(prediction: str, expected: list[str]) -> float:
    """Share of expected values that appear in the prediction (case-insensitive), in [0, 1]."""
    if not expected:
        raise ValueError("string_match_all needs at least one expected value")
    text = prediction.lower()
    return sum(v.lower() in text for v in expected) / len(expected)


def answer_ended(text: str) -> bool:
    """Whether greedy decoding may stop: a newline after the answer's first non-blank character ends it.  Leading
    blank lines do not (Gemma-3-270M often opens with them, as in ``":\\n\\n    1502111."``)."""
    return "\n" in text.lstrip()
