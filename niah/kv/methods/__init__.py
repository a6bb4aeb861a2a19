"""KV-cache methods: one module per format or tightly coupled family, each registering its names
(:mod:`niah.kv.registry`)."""
