"""Speed benchmarks that print ratios measured in one run (machines are noisy; absolute numbers are not targets).

* :func:`codec_throughput`: quantize and dequantize throughput of each KV method, as a ratio to a plain
  copy of the same fp32 tensor into a preallocated buffer, measured in the same run (``clone()`` is not used as
  the reference: its fresh allocation's page faults make it vary widely between runs).
* :func:`decode_attention`: one decode step's attention over a long packed cache, as a ratio to the same step
  over the fp32 cache: dequantize what the cache stores then SDPA, and the chunk-by-chunk read of
  :mod:`niah.kv.attend`.
* :func:`hf_quantized_cache`: transformers' own ``QuantizedCache`` (quanto backend) against its
  ``DynamicCache`` on a real model and context: what a user would otherwise pick.
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import DynamicCache, QuantizedCache

from ..kv.attend import decode_attention as decode_attention_step
from ..kv.cache import FusedDecodeLayer, PackedLayer
from ..kv.registry import get_method


def median_time(fn, repeat: int = 5) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_ratio(fn, ref, repeat: int = 9) -> tuple[float, float]:
    """``(median seconds of fn, median of fn / ref)``, the two timed alternately after one warm-up each: each
    ratio compares neighbouring runs, so a machine that slows down for a while moves both of them."""
    fn(), ref()
    times, ratios = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ref()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        times.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(times), statistics.median(ratios)


def _kv(tokens: int, kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """A K-like tensor ``(1, kv_heads, tokens, head_dim)``: gaussian with a few large channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, kv_heads, tokens, head_dim, generator=g)
    x[..., :4] *= 8.0
    return x


def codec_throughput(
    methods: list[str], tokens: int = 16384, kv_heads: int = 3, head_dim: int = 64, repeat: int = 9
) -> pd.DataFrame:
    """Per method: MB/s of fp32 input quantized and of fp32 output dequantized, and both as a share of copy speed
    (the median of ratios to copies timed alternately with them, :func:`paired_ratio`).

    The last rows time TurboQuant's dense ``d x d`` rotation alone (``2 d`` flops per value, against the copy's
    8 bytes per value), and the two products that ``TurboQuant_prod``'s quantize cannot avoid (the rotation, then
    the QJL matrix ``S`` on the residual): no encoder with those dense products can beat these shares of copy.
    """
    x = _kv(tokens, kv_heads, head_dim)
    mb = x.numel() * x.element_size() / 1e6
    dst = torch.empty_like(x)

    def copy():  # into a buffer allocated once: the machine's copy bandwidth
        dst.copy_(x)

    copy_s = median_time(copy, repeat)
    rows = []
    for name in methods:
        q = get_method(name).key.for_layer(0)
        packed = q.quantize(x)
        qs, q_ratio = paired_ratio(lambda: q.quantize(x), copy, repeat)
        ds, d_ratio = paired_ratio(lambda: q.dequantize(packed), copy, repeat)
        rows.append(
            {
                "method": name,
                "copy_MBps": mb / copy_s,
                "quantize_MBps": mb / qs,
                "dequantize_MBps": mb / ds,
                "quantize_vs_copy": 1 / q_ratio,
                "dequantize_vs_copy": 1 / d_ratio,
            }
        )
    rot = torch.linalg.qr(torch.randn(kv_heads, head_dim, head_dim))[0]
    qjl = torch.randn(kv_heads, head_dim, head_dim)

    def rotate():
        return torch.matmul(x, rot.transpose(-1, -2))

    floors = {
        "rotation matmul alone (TurboQuant's floor)": rotate,
        "rotation and QJL matmuls (TurboQuant_prod's floor)": lambda: torch.matmul(rotate(), qjl.transpose(-1, -2)),
    }
    for name, floor in floors.items():
        floor_s, floor_ratio = paired_ratio(floor, copy, repeat)
        rows.append(
            {
                "method": name,
                "copy_MBps": mb / copy_s,
                "quantize_MBps": mb / floor_s,
                "quantize_vs_copy": 1 / floor_ratio,
            }
        )
    return pd.DataFrame(rows)


def decode_attention(
    methods: list[str], tokens: int = 16384, kv_heads: int = 3, q_heads: int = 9, head_dim: int = 64, repeat: int = 9
) -> pd.DataFrame:
    """One decode step of one layer over ``tokens`` cached tokens: ms per method and ratio to the fp32 cache
    (the median of ratios to reference steps timed alternately with it, :func:`paired_ratio`).

    The reference writes the new token into a preallocated fp32 cache and runs SDPA with ``enable_gqa``; a
    second row shows the ``torch.cat`` per step of transformers' ``DynamicCache`` (its fresh 2 x 12 MB
    allocations made it vary 3x between runs here, so it is not the reference).
    Each step appends one token to a :class:`PackedLayer` that keeps nothing dequantized (the real decode path:
    the stored cache is read at every step), then attends, two ways: ``dequantize``: dequantize the whole
    stored cache, then SDPA with ``enable_gqa``; ``per chunk``: the decode step of :mod:`niah.kv.attend`
    (each stored chunk scored on its own; TurboQuant-MSE from its codes).
    """
    k, v = _kv(tokens, kv_heads, head_dim, 1), _kv(tokens, kv_heads, head_dim, 2)
    q = torch.randn(1, q_heads, 1, head_dim)
    k1, v1 = k[..., -1:, :].clone(), v[..., -1:, :].clone()
    scaling = head_dim**-0.5
    k_all, v_all = torch.cat([k, k1], 2), torch.cat([v, v1], 2)  # the fp32 cache, allocated once (a static cache)

    def fp32_step():
        k_all[..., -1:, :].copy_(k1)
        v_all[..., -1:, :].copy_(v1)
        F.scaled_dot_product_attention(q, k_all, v_all, enable_gqa=True)

    def fp32_cat_step():  # what transformers' DynamicCache does: a new cache tensor per step
        F.scaled_dot_product_attention(q, torch.cat([k, k1], 2), torch.cat([v, v1], 2), enable_gqa=True)

    base = median_time(fp32_step, repeat)
    cat, cat_ratio = paired_ratio(fp32_cat_step, fp32_step, repeat)
    rows = [
        {"method": "fp32 (no cache method)", "path": "sdpa", "step_ms": 1e3 * base, "ratio_to_fp32": 1.0},
        {
            "method": "fp32 (no cache method)",
            "path": "torch.cat + sdpa",
            "step_ms": 1e3 * cat,
            "ratio_to_fp32": cat_ratio,
        },
    ]
    for name in methods:
        for path in ("dequantize", "per chunk"):
            layer = (FusedDecodeLayer if path == "per chunk" else PackedLayer)(
                get_method(name), 0, keep_dequantized=False
            )
            layer.update(k, v)

            def step():
                keys, values = layer.update(k1, v1)
                if path == "per chunk":
                    decode_attention_step(q, layer, scaling)
                else:
                    F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

            s, ratio = paired_ratio(step, fp32_step, repeat)
            rows.append({"method": name, "path": path, "step_ms": 1e3 * s, "ratio_to_fp32": ratio})
    return pd.DataFrame(rows)


@torch.no_grad()
def hf_quantized_cache(lm, context_ids: list[int], steps: int = 16, nbits_list=(4, 2)) -> pd.DataFrame:
    """Decode ms/token of transformers' ``DynamicCache`` and ``QuantizedCache(backend="quanto")`` after the same
    prefill."""

    def decode_ms(cache) -> float:
        ids = torch.tensor([context_ids])
        out = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = lm.model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        return 1e3 * (time.perf_counter() - t0) / steps

    rows = [{"cache": "DynamicCache (fp32)", "decode_ms_per_token": decode_ms(DynamicCache(config=lm.model.config))}]
    for nbits in nbits_list:
        try:
            cache = QuantizedCache(backend="quanto", config=lm.model.config, nbits=nbits)
        except ImportError as err:
            rows.append(
                {
                    "cache": f"QuantizedCache quanto int{nbits}",
                    "decode_ms_per_token": float("nan"),
                    "note": str(err)[:120],
                }
            )
            continue
        rows.append({"cache": f"QuantizedCache quanto int{nbits}", "decode_ms_per_token": decode_ms(cache)})
    df = pd.DataFrame(rows)
    df["ratio_to_dynamic"] = df["decode_ms_per_token"] / df["decode_ms_per_token"].iloc[0]
    return df
