"""Numba CPU kernels of the KV formats: the row-reading machinery (:mod:`.rowkernels`) and TurboQuant's encoders
and readers."""
