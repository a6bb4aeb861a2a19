"""Weight and activation quantization of the decoder linears, measured on held-out text and on needle retrieval.

Modules (each short): ``data`` (calibration / evaluation split of the pydoc haystack), ``quant`` (integer
quantizers), ``pack`` (the stored form and its bytes), ``salience`` (activation statistics, channel choices,
masks, kurtosis), ``awq`` (AWQ's scale search), ``autoround`` (Intel auto-round on the CPU, and what it
offers for W4A8), ``cache`` (quantized weights cached outside git), ``schemes`` (what a configuration does,
applied with hooks), ``evaluate`` (perplexity, KL, top-1, repetition), ``needle`` (weight schemes x KV
methods), ``study`` (the notebooks' entry point and its results rows), ``plots``, ``source`` (the tensor
formats of the GGUF a model was dequantized from).
"""
