"""KV method names resolved into cache specs under a config: the one place that reads ``niah.engine_chunk`` and that
gives ``+static`` methods their calibrated key statistics (:mod:`.keystats`)."""

from __future__ import annotations

from dataclasses import replace

from ..kv.spec import CacheSpec
from .keystats import with_key_stats


def cache_spec(cfg, name: str, lm=None, **knobs) -> CacheSpec:
    """KV method ``name`` resolved for a cache under ``cfg``, the one place that reads its engine prompt chunk
    (``niah.engine_chunk``); ``lm``: the model whose ``+static`` key statistics it takes (:mod:`.keystats`; without
    it, such a method can be checked but not stored); ``knobs``: the runner's other :class:`~niah.kv.spec.CacheSpec`
    fields."""
    spec = CacheSpec.resolve(name, cfg.niah.engine_chunk, **knobs)
    if lm is None:
        return spec
    return replace(spec, method=with_key_stats(spec.method, cfg, lm))


def check_engine_reads(specs: dict[str, CacheSpec], longest_context: int) -> None:
    """Raise unless every ``engine``-mode method among ``specs`` (name -> :class:`~niah.kv.spec.CacheSpec`) can be
    read so here: a context longer than the prompt chunk would need a prefill per method for its later chunks (they
    read the first chunk dequantized), which this repo does not run; the shared prefill reads raw keys and values
    throughout."""
    engine = [name for name, spec in specs.items() if spec.engine_chunk is not None]
    chunk = min((specs[name].engine_chunk for name in engine), default=longest_context)
    if longest_context > chunk:
        raise ValueError(
            f"{', '.join(engine)}: a {longest_context}-token context is longer than niah.engine_chunk ({chunk} "
            "tokens), and its later chunks would need a prefill per method, which this repo does not run yet: raise "
            f"niah.engine_chunk to at least {longest_context} (vLLM's max_num_batched_tokens) or drop the longer "
            "lengths"
        )
