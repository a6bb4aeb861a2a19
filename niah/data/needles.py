"""Needles (seeded values in RULER-style sentences), prompts, and their insertion in token space.

A trial is fully determined by ``(seed, length, depth, trial)``: keys, values and distractor
positions come from one ``random.Random`` seeded with those numbers.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from .haystack import TokenHaystack

KEY_WORDS = (
    "amber anchor apple arrow basil beacon birch bishop cactus canyon cedar cobalt comet copper coral crater "
    "crystal dagger delta ember falcon fern fjord garnet glacier granite harbor hazel heron indigo iris ivory "
    "jasper juniper kestrel lagoon lantern laurel lotus maple marble meadow mercury nectar nickel oasis obsidian "
    "onyx orchid otter pebble pepper pine plum quartz raven reef saffron sapphire sequoia silver sparrow spruce "
    "thistle tiger topaz tundra umber velvet violet walnut willow zephyr"
).split()

VALUE_KINDS = {
    "number": lambda rng: str(rng.randint(1_000_000, 9_999_999)),
    "uuid": lambda rng: str(uuid.UUID(int=rng.getrandbits(128), version=4)),
    "percent": lambda rng: f"{rng.randint(2, 97)}%",
}
NOUN = {"number": "special magic number", "uuid": "special magic uuid", "percent": "special magic percentage"}
VARIANTS = ("single", "multi_key", "multi_value", "multi_query")

INTRO = (
    "Some {nouns} are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about them afterwards.\n"
)
NEEDLE = " One of the {noun}s for {key} is: {value}."
QUESTION = "\nWhat {be} the {noun}{s} for {keys} mentioned in the provided text?"
# RULER's answer prefix ends at "is"; the needle reads "is: <value>", so models first write ":" there and the
# teacher-forced value was scored at a position the model never puts it.  Ending the prefix as the needle does lets
# the answer follow directly (log-prob of the value itself, and no decode steps when the answer is right).
ANSWER_PREFIX = " The {noun}{s} for {keys} mentioned in the provided text {be}:"


@dataclass
class NeedleSpec:
    """What to hide: ``kind`` of value, ``variant``, and how many distractors/values/queries."""

    kind: str = "number"
    variant: str = "single"
    count: int = 4  # distractor needles (multi_key), values (multi_value) or queried keys (multi_query)

    def __post_init__(self):
        if self.kind not in VALUE_KINDS:
            raise ValueError(f"unknown needle kind {self.kind!r}: choose {', '.join(VALUE_KINDS)}")
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown needle variant {self.variant!r}: choose {', '.join(VARIANTS)}")


@dataclass
class Trial:
    """The needles of one cell: ``needles`` are (key, value) pairs in insertion order, the first at the depth."""

    needles: list[tuple[str, str]]
    queried_keys: list[str]
    expected: list[str]
    kind: str
    extra_positions: list[float] = field(default_factory=list)  # depths in [0, 1] of needles 2..n


def make_trial(spec: NeedleSpec, rng: random.Random) -> Trial:
    """Draw keys and values for one trial."""
    draw = VALUE_KINDS[spec.kind]
    n = 1 if spec.variant == "single" else spec.count
    keys = rng.sample(KEY_WORDS, n if spec.variant in ("multi_key", "multi_query") else 1)
    if spec.variant == "multi_value":
        needles = [(keys[0], draw(rng)) for _ in range(n)]
        queried, expected = keys, [v for _, v in needles]
    else:
        needles = [(k, draw(rng)) for k in keys]
        queried = keys if spec.variant == "multi_query" else keys[:1]
        expected = [v for k, v in needles if k in queried]
    return Trial(needles, queried, expected, spec.kind, [rng.random() for _ in needles[1:]])


def needle_text(kind: str, key: str, value: str) -> str:
    return NEEDLE.format(noun=NOUN[kind], key=key, value=value)


def question_texts(trial: Trial) -> tuple[str, str]:
    """(question, answer prefix) for the trial."""
    plural = len(trial.expected) > 1
    fmt = dict(
        noun=NOUN[trial.kind],
        s="s" if plural else "",
        be="are" if plural else "is",
        keys=" and ".join(trial.queried_keys),
    )
    return QUESTION.format(**fmt), ANSWER_PREFIX.format(**fmt)


def insert_needles(
    hay: TokenHaystack, budget: int, depth: float, needle_ids: list[list[int]], extra: list[float]
) -> tuple[list[int], int, int]:
    """Fill ``budget`` tokens with haystack plus needles.

    The first needle goes at the sentence start nearest to ``depth`` of the haystack part; the others at
    ``extra`` depths. Returns (ids, index of the first needle's first token, tokens before any needle):
    the last number is the haystack prefix this context shares with every other context.
    """
    n_hay = budget - sum(len(n) for n in needle_ids)
    if n_hay <= 0:
        raise ValueError(
            f"no room for haystack: {budget} tokens are left after the prompt's intro, "
            f"and the needles alone take {budget - n_hay}; use a longer length"
        )
    body = TokenHaystack(hay.ids[:n_hay], [s for s in hay.starts if s < n_hay])
    spots = [body.nearest_start(d * n_hay) for d in [depth, *extra]]
    order = sorted(range(len(spots)), key=lambda i: (spots[i], i))
    ids, last, first_at = [], 0, 0
    for i in order:
        ids.extend(body.ids[last : spots[i]])
        if i == 0:
            first_at = len(ids)
        ids.extend(needle_ids[i])
        last = spots[i]
    ids.extend(body.ids[last:])
    return ids, first_at, min(spots)
