"""Scores: RULER's ``string_match_all`` and the Wilson interval for accuracies."""

from __future__ import annotations

import math


def string_match_all(prediction: str, expected: list[str]) -> float:
    """Share of expected values that appear in the prediction (case-insensitive), in [0, 1]."""
    if not expected:
        raise ValueError("string_match_all needs at least one expected value")
    text = prediction.lower()
    return sum(v.lower() in text for v in expected) / len(expected)


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (``successes`` may be fractional, e.g. summed scores)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def answer_ended(text: str) -> bool:
    """Whether greedy decoding may stop: a newline after the answer's first non-blank character ends it.  Leading
    blank lines do not (Gemma-3-270M often opens with them, as in ``":\\n\\n    1502111."``)."""
    return "\n" in text.lstrip()
