"""KV-cache methods: codecs (:mod:`.methods`), their registry (:mod:`.registry`) and the packed cache
(:mod:`.cache`).  ``niah.kv.cache_for(model, method)``: a cache that ``model.generate()`` takes
(:func:`.cache.cache_for`); imported on first use, so that importing the registry stays light."""


def __getattr__(name: str):
    if name == "cache_for":
        from .cache import cache_for  # heavy: transformers, only for a user's own model

        return cache_for
    raise AttributeError(f"module 'niah.kv' has no attribute {name!r}")
