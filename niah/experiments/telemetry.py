"""Memory telemetry: a background sampler of process RSS (CPU) or device memory (CUDA, through pynvml).

Use it as a context manager; it samples at ``hz`` (20 Hz or faster) and always joins its thread:

    with MemorySampler(hz=50) as s:
        work()
    s.times, s.values  # seconds since start, bytes
"""

from __future__ import annotations

import os
import threading
import time

import psutil


def nvml_index(cuda_index: int) -> int | str:
    """The NVML handle of the GPU torch calls ``cuda:cuda_index``: NVML counts every GPU of the machine, torch
    only those in ``CUDA_VISIBLE_DEVICES`` (which Ray sets for each actor).  An int, or the entry's UUID."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return cuda_index
    entry = visible[cuda_index]
    return int(entry) if entry.isdigit() else entry


def _cuda_reader(cuda_indices: list[int]):
    """Bytes used on those GPUs together, through pynvml, or None when pynvml cannot see them."""
    try:
        import pynvml  # optional: without NVML the CUDA allocator's count stands in

        pynvml.nvmlInit()
        handles = []
        for i in cuda_indices:
            h = nvml_index(i)
            handles.append(
                pynvml.nvmlDeviceGetHandleByUUID(h) if isinstance(h, str) else pynvml.nvmlDeviceGetHandleByIndex(h)
            )
    except Exception:  # no library, driver or device: fall back to the CUDA allocator
        return None
    return lambda: sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)


def model_cuda_devices(model) -> list[int]:
    """The CUDA device indices holding ``model``'s parameters (one, or several for a model spread with a
    device map); [] on the CPU."""
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


class MemorySampler:
    """Samples memory in a daemon thread between ``start()`` and ``stop()`` (or a ``with`` block).

    ``source``: ``"rss"`` (this process's resident memory) or ``"cuda"`` (pynvml's used memory of the CUDA
    ``devices``, summed; default the current one; the CUDA allocator's ``memory_allocated`` if pynvml is missing).
    """

    def __init__(self, hz: float = 50.0, source: str = "rss", devices: list[int] | None = None):
        if hz < 20:
            raise ValueError(f"sample at 20 Hz or faster to see sub-second memory changes; got {hz}")
        if source not in ("rss", "cuda"):
            raise ValueError(f"unknown memory source {source!r}: use 'rss' or 'cuda'")
        self.period = 1.0 / hz
        self.source = source
        self.devices = devices
        self.reader = ""  # what was read, set by start(): psutil rss, pynvml or torch.cuda.memory_allocated
        self.times: list[float] = []
        self.values: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _reader(self):
        if self.source == "rss":
            proc = psutil.Process()
            self.reader = "psutil rss"
            return lambda: proc.memory_info().rss
        import torch  # heavy: torch, for the cuda source only

        devices = self.devices or [torch.cuda.current_device()]
        nvml = _cuda_reader(devices)
        self.reader = "pynvml" if nvml else "torch.cuda.memory_allocated"
        return nvml or (lambda: sum(torch.cuda.memory_allocated(i) for i in devices))

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
