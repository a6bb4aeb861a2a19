"""Haystacks: texts to hide needles in, tokenized sentence by sentence.

Three sources:

* ``pydoc``: the technical prose of ``pydoc_data.topics`` (ships with CPython; about 113K SmolLM2 tokens);
* ``noise``: RULER's repeated filler ("The grass is green. The sky is blue. ...");
* ``folder``: every UTF-8 ``*.txt`` file in ``data/haystack/`` (or a folder you name), Chinese included.

Tokenizing sentence by sentence gives exact sentence boundaries in token space, where needles go.
"""

from __future__ import annotations

import bisect
import codecs
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# a sentence ends at . ! ? followed by whitespace, or right after a CJK full stop / mark
_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)|(?<=[。！？])")
# what a reader does not see: whitespace, C0/C1 control characters, zero-width marks and the byte-order mark
_INVISIBLE = re.compile(r"[\s\x00-\x1f\x7f-\x9f\u200b-\u200f\ufeff]")


def pydoc_text() -> str:
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def folder_files(folder: str | Path) -> list[Path]:
    """The ``*.txt`` files of a haystack folder, each checked to be a readable UTF-8 file of which at least half the
    characters are visible (not whitespace or control characters: a file of NUL bytes would fill a context with
    them); streamed in 1 MiB blocks, so that checking a large folder holds none of it in memory.  Raises
    ``FileNotFoundError`` or ``ValueError`` naming the file and the fix."""
    folder = Path(folder)
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(
            f"haystack folder {folder} has no *.txt files: add UTF-8 text files or pick 'pydoc' or 'noise'"
        )
    for f in files:
        try:
            if f.is_symlink() and not f.exists():
                raise ValueError(
                    f"haystack entry {f} is a broken or looping symbolic link: remove it from {folder} or fix it"
                )
            if not f.is_file():
                raise ValueError(f"haystack entry {f} is not a regular file: remove it from {folder} or rename it")
            decoder, size, chars, visible = codecs.getincrementaldecoder("utf-8")(), 0, 0, 0
            with open(f, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    text = decoder.decode(block)
                    size, chars, visible = size + len(block), chars + len(text), visible + len(_INVISIBLE.sub("", text))
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise ValueError(f"haystack file {f} is not valid UTF-8 ({err.reason}): re-save it as UTF-8") from None
        except OSError as err:
            raise ValueError(
                f"haystack file {f} cannot be read ({err.strerror}): fix it or remove it from {folder}"
            ) from None
        if size == 0:
            raise ValueError(f"haystack file {f} is empty: fill it or remove it from {folder}")
        if visible < chars / 2:
            raise ValueError(
                f"haystack file {f} is mostly whitespace or control characters ({visible:,} of {chars:,} characters "
                f"visible), not text: replace it or remove it from {folder}"
            )
    return files


def folder_text(folder: str | Path) -> str:
    """Every file of :func:`folder_files`, in name order, separated by blank lines."""
    return "\n\n".join(f.read_text(encoding="utf-8") for f in folder_files(folder))


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


def iter_sentences(text: str):
    """The pieces of :func:`split_sentences` one at a time, without splitting the rest of ``text`` (a 300 MB
    haystack folder costs only the sentences a run tokenizes)."""
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.start() > start:
            yield text[start : m.start()]
        start = m.start()
    if start < len(text):
        yield text[start:]


def split_sentences(text: str) -> list[str]:
    """Pieces that each start with their own leading whitespace, so BPE tokens never straddle two pieces."""
    return list(iter_sentences(text))


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


class HaystackTooShort(ValueError):
    """The haystack text holds fewer tokens than asked, and repeating it is not allowed."""


def tokenize_haystack(text: str, tokenizer, n_tokens: int, repeat: bool = True) -> TokenHaystack:
    """Tokenize whole sentences until there are at least ``n_tokens`` tokens; repeat the text (with a warning) if
    short, or raise :class:`HaystackTooShort` when ``repeat`` is False."""
    if not text:
        raise ValueError("the haystack text is empty")
    ids: list[int] = []
    starts: list[int] = []
    rounds = 0
    while len(ids) < n_tokens:
        before = len(ids)
        for piece in iter_sentences(text):
            starts.append(len(ids))
            ids.extend(tokenizer.encode(piece, add_special_tokens=False))
            if len(ids) >= n_tokens:
                break
        rounds += 1
        if len(ids) == before:
            raise ValueError("the haystack text tokenizes to no tokens at all")
        if len(ids) < n_tokens and not repeat:
            raise HaystackTooShort(f"the haystack holds {len(ids)} tokens, fewer than the {n_tokens} asked")
    if rounds > 1:
        warnings.warn(
            f"the haystack text is shorter than {n_tokens} tokens; it was repeated {rounds} times", stacklevel=2
        )
    return TokenHaystack(ids, starts)
