"""Memory telemetry: a background sampler of process RSS (CPU) or device memory (CUDA, through pynvml).

Use it as a context manager; it samples at ``hz`` (20 Hz or faster) and always joins its thread:

    with MemorySampler(hz=50) as s:
        work()
    s.times, s.values  # seconds since start, bytes
"""

from __future__ import annotations

import threading
import time

import psutil


def _cuda_reader(device_index: int):
    """Bytes used on GPU ``device_index`` through pynvml, or None when pynvml cannot see it."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:  # no library, driver or device: fall back to the CUDA allocator
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used


class MemorySampler:
    """Samples memory in a daemon thread between ``start()`` and ``stop()`` (or a ``with`` block).

    ``source``: ``"rss"`` (this process's resident memory) or ``"cuda"`` (pynvml's used memory of the
    current device; the CUDA allocator's ``memory_allocated`` if pynvml is missing).
    """

    def __init__(self, hz: float = 50.0, source: str = "rss"):
        if hz < 20:
            raise ValueError(f"sample at 20 Hz or faster to see sub-second memory changes; got {hz}")
        if source not in ("rss", "cuda"):
            raise ValueError(f"unknown memory source {source!r}: use 'rss' or 'cuda'")
        self.period = 1.0 / hz
        self.source = source
        self.times: list[float] = []
        self.values: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _reader(self):
        if self.source == "rss":
            proc = psutil.Process()
            return lambda: proc.memory_info().rss
        import torch

        nvml = _cuda_reader(torch.cuda.current_device())
        return nvml or torch.cuda.memory_allocated

    def _run(self, read, t0: float) -> None:
        next_t = t0
        while not self._stop.is_set():
            self.times.append(time.perf_counter() - t0)
            self.values.append(int(read()))
            next_t += self.period
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def start(self) -> "MemorySampler":
        if self._thread is not None:
            raise RuntimeError("this sampler was already started; make a new one")
        read, t0 = self._reader(), time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(read, t0), name="niah-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "MemorySampler":
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def peak(self) -> int:
        return max(self.values, default=0)
