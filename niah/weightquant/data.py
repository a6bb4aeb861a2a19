"""Calibration and evaluation texts: the pydoc haystack split by topic key, cut into token windows.

``pydoc_data.topics`` maps about 90 topic keys to their text.  A key belongs to the calibration split
when the first 8 hex digits of ``sha256(key)``, read as an integer, fall below ``share * 16**8``
(a fixed, documented rule that does not depend on the Python version's key order); every other key is
held out for evaluation.  Calibration (AutoRound, activation salience, AWQ) reads only calibration keys;
perplexity, KL, generation prompts and the needle haystack read only evaluation keys.
"""

from __future__ import annotations

import hashlib
from pydoc_data.topics import topics

import torch


def split_keys(share: float) -> tuple[list[str], list[str]]:
    """(calibration keys, evaluation keys) of ``pydoc_data.topics``, each sorted."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"weightquant.calibration_share must lie strictly between 0 and 1; got {share}")
    calib = [k for k in sorted(topics) if int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) < share * 16**8]
    held = [k for k in sorted(topics) if k not in set(calib)]
    return calib, held


def split_text(part: str, share: float) -> str:
    """The text of the ``calibration`` or ``evaluation`` keys, joined as :func:`niah.data.haystack.pydoc_text` does."""
    calib, held = split_keys(share)
    keys = {"calibration": calib, "evaluation": held}.get(part)
    if keys is None:
        raise ValueError(f"unknown split {part!r}: use 'calibration' or 'evaluation'")
    return "\n\n".join(topics[k].strip() for k in keys)


def token_windows(tokenizer, text: str, count: int, length: int) -> torch.Tensor:
    """``count`` consecutive non-overlapping windows of ``length`` tokens from the start of ``text``:
    ``(count, length)``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < count * length:
        raise ValueError(
            f"the split has {len(ids)} tokens, fewer than {count} windows x {length}; lower the count or the length"
        )
    return torch.tensor(ids[: count * length]).view(count, length)


def windows_hash(windows: torch.Tensor) -> str:
    """16 hex digits identifying a set of token windows (the calibration hash of the cache keys)."""
    data = windows.to(torch.int64).numpy().tobytes() + str(tuple(windows.shape)).encode()
    return hashlib.sha256(data).hexdigest()[:16]
