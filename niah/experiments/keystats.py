"""Per-model key statistics for ``+static`` methods (:class:`~niah.kv.methods.affine.KeyAffine`), calibrated once.

An engine stores a prompt's first chunk before it has read the rest, so it cannot take a prompt's own key mean and
scale; it can ship statistics measured once per model, as KVQuantizer's offline per-channel zero-points (KVQuant,
arXiv 2401.18079) and the calibrated bias of PrismML-Eng/llama.cpp#51 do.  :func:`key_stats` prefills
:data:`WINDOWS` windows of :data:`LENGTH` tokens of the calibration split that notebooks 01-02 hold out
(:func:`niah.weightquant.data.split_text`; ``weightquant.calibration_share``) and keeps each attention layer's
per-channel mean of keys and of their squares.  They are saved under ``cache_dir()/keystats/``, keyed by a
fingerprint of the model's weights (a re-quantized model gets its own) and the calibration tokens.
"""

from __future__ import annotations

import hashlib
import os

import torch
from safetensors.torch import load_file, save_file

from ..kv.methods.affine import KeyAffine, KeyStats
from ..kv.methods.sink import Sink
from ..kv.registry import KVMethod
from ..models import cache_dir
from ..schema import ConfigError
from ..weightquant.data import split_text, token_windows, windows_hash
from .protocol import context_states, prefill

WINDOWS, LENGTH = 4, 2048  # 8,192 calibration tokens
_MEMO: dict[str, KeyStats] = {}


def with_key_stats(method: KVMethod, cfg, lm) -> KVMethod:
    """``method`` with its ``+static`` key statistics calibrated on ``lm`` (a method without them: unchanged)."""
    affine = method.key_statistics
    if affine is None or not affine.static:
        return method
    stats = key_stats(cfg, lm)
    inner = KeyAffine(affine.inner, affine.centre, affine.scale, True, stats)
    key = Sink(inner, method.key.n) if isinstance(method.key, Sink) else inner
    return KVMethod(method.name, key, method.value, method.layers, method.read_mode, method.recent)


def key_stats(cfg, lm) -> KeyStats:
    """``lm``'s key statistics on the config's calibration split, computed once and kept on disk."""
    windows = _windows(cfg, lm)
    name = f"{_fingerprint(lm.model)}-{windows_hash(windows)}"
    if name not in _MEMO:
        path = cache_dir() / "keystats" / f"{name}.safetensors"
        _MEMO[name] = _load(path) if path.exists() else _save(path, _measure(lm.model, windows))
    return _MEMO[name]


def _windows(cfg, lm) -> torch.Tensor:
    text = split_text("calibration", cfg.weightquant.calibration_share)
    length = min(LENGTH, lm.max_context)
    try:
        return token_windows(lm.tokenizer, text, WINDOWS, length)
    except ValueError as err:
        raise ConfigError(f"+static key statistics: the calibration split is too short ({err})") from None


@torch.no_grad()
def _measure(model, windows: torch.Tensor) -> KeyStats:
    """Mean of keys and of their squares per attention layer, over every calibration token: float32 ``(H, D)``."""
    sums: dict[int, list[torch.Tensor]] = {}
    for ids in windows.tolist():
        for i, st in enumerate(context_states(prefill(model, ids))):
            if st.keys is not None:
                k = st.keys.float()[0]  # (H, T, D)
                total = sums.setdefault(i, [0, 0, 0])
                total[0], total[1], total[2] = total[0] + k.sum(1), total[1] + k.square().sum(1), total[2] + k.shape[1]
    return KeyStats({i: s / n for i, (s, _, n) in sums.items()}, {i: q / n for i, (_, q, n) in sums.items()})


def _fingerprint(model) -> str:
    """16 hex digits of the weights: each tensor's name, shape and norm."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        h.update(f"{name}{tuple(p.shape)}{float(p.float().norm()):.6e}".encode())
    return h.hexdigest()[:16]


def _save(path, stats: KeyStats) -> KeyStats:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tensors = {f"mean.{i}": t.contiguous() for i, t in stats.mean.items()}
    save_file(tensors | {f"meansq.{i}": t.contiguous() for i, t in stats.meansq.items()}, str(tmp))
    os.replace(tmp, path)  # whole or absent: a killed run never leaves half a file
    return stats


def _load(path) -> KeyStats:
    t = load_file(str(path))
    kinds = ("mean", "meansq")
    return KeyStats(*({int(k.split(".")[1]): v for k, v in t.items() if k.startswith(f"{kind}.")} for kind in kinds))


@torch.no_grad()
def key_drift(cfg, lm, ids: list[int], lengths: list[int], tokens: int = 511) -> dict[int, list[float]]:
    """How far the keys at the end of a context sit from :func:`key_stats`: per context length ``L`` in ``lengths``
    (a prefix of ``ids``), one value per attention layer, the mean over heads and channels of ``|m - mu| / sd``,
    with ``m`` the mean of the layer's last ``tokens`` keys (what a sliding-window layer holds) and ``mu``, ``sd``
    the calibrated mean and standard deviation.  Keys carry the rotary embedding, so statistics taken at positions
    below :data:`LENGTH` need not fit keys at later positions; this measures by how much."""
    stats = key_stats(cfg, lm)
    out = {}
    for length in lengths:
        drift = []
        for i, st in enumerate(context_states(prefill(lm.model, ids[:length], None, cfg.niah.prefill_chunk))):
            if st.keys is not None:
                mu, sd = stats.mean[i], (stats.meansq[i] - stats.mean[i].square()).clamp_min(1e-12).sqrt()
                m = st.keys.float()[0, :, -tokens:].mean(1)  # (H, D)
                drift.append(((m - mu).abs() / sd).mean().item())
        out[length] = drift
    return out
