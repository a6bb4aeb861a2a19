"""Haystacks: texts to hide needles in, tokenized sentence by sentence.

Three sources:

* ``pydoc``: the technical prose of ``pydoc_data.topics`` (ships with CPython; about 113K SmolLM2 tokens);
* ``noise``: RULER's repeated filler ("The grass is green. The sky is blue. ...");
* ``folder``: every UTF-8 ``*.txt`` file in ``data/haystack/`` (or a folder you name), Chinese included.

Tokenizing sentence by sentence gives exact sentence boundaries in token space, where needles go.
"""

from __future__ import annotations

import bisect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# a sentence ends at . ! ? followed by whitespace, or right after a CJK full stop / mark
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)|(?<=[。！？])")


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def folder_text(folder: str | Path) -> str:
    folder = Path(folder)
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"haystack folder {folder} has no *.txt files: add UTF-8 text files or pick 'pydoc' or 'noise'")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"haystack file {f} is not valid UTF-8 ({err.reason} at byte {err.start}): re-save it as UTF-8") from None
    return "\n\n".join(parts)


SOURCES = ("pydoc", "noise", "folder")


def haystack_text(name: str, folder: str | Path = "data/haystack") -> str:
    """The raw text of a haystack source: ``pydoc``, ``noise`` or ``folder``."""
    if name == "pydoc":
        return pydoc_text()
    if name == "noise":
        return NOISE * 2000
    if name == "folder":
        return folder_text(folder)
    raise ValueError(f"unknown haystack {name!r}: choose pydoc, noise or folder")


def split_sentences(text: str) -> list[str]:
    """Pieces that each start with their own leading whitespace, so BPE tokens never straddle two pieces."""
    return [p for p in _SENTENCE_END.split(text) if p]


@dataclass
class TokenHaystack:
    """``ids``: the haystack's token ids; ``starts``: token indices where a sentence starts (0 included)."""

    ids: list[int]
    starts: list[int]

    def nearest_start(self, position: float) -> int:
        """The sentence start closest to token ``position`` (ties go to the earlier one)."""
        return min(self.starts, key=lambda s: (abs(s - position), s))

    def start_before(self, position: float) -> int:
        """The last sentence start at or before token ``position`` (0 if none)."""
        return self.starts[max(bisect.bisect_right(self.starts, position) - 1, 0)]


def tokenize_haystack(text: str, tokenizer, n_tokens: int) -> TokenHaystack:
    """Tokenize whole sentences until there are at least ``n_tokens`` tokens; repeat the text (with a warning) if short."""
    pieces = split_sentences(text)
    if not pieces:
        raise ValueError("the haystack text is empty")
    ids: list[int] = []
    starts: list[int] = []
    rounds = 0
    while len(ids) < n_tokens:
        for piece in pieces:
            starts.append(len(ids))
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
            if len(ids) >= n_tokens:
                break
        rounds += 1
    if rounds > 1:
        warnings.warn(f"the haystack text is shorter than {n_tokens} tokens; it was repeated {rounds} times", stacklevel=2)
    return TokenHaystack(ids, starts)
