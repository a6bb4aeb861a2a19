import threading
import time

import numpy as np
import pytest

from niah.experiments.telemetry import MemorySampler
from niah.report.fits import dominant_period, polyfit


def test_sampler_samples_fast_enough_and_never_leaks_its_thread():
    before = threading.active_count()
    with MemorySampler(hz=50) as s:
        blob = bytearray(64 << 20)  # 64 MiB, touched
        blob[::4096] = b"x" * len(blob[::4096])
        time.sleep(0.4)
        del blob
    assert threading.active_count() == before
    assert len(s.times) >= 10 and all(b > a for a, b in zip(s.times, s.times[1:]))
    assert s.peak > 0
    with pytest.raises(RuntimeError):
        s.start()
    with pytest.raises(ValueError, match="20 Hz"):
        MemorySampler(hz=5)


def test_linear_and_quadratic_fits_recover_known_curves():
    x = np.array([1, 256, 512, 1024, 2048, 4096, 8192, 16384])
    lin = polyfit(x, 36864 * x + 1000, 1)
    assert lin.coef[0] == pytest.approx(36864) and lin.r2 == pytest.approx(1.0)
    quad = polyfit(x, 2e-7 * x**2 + 3e-3 * x, 2)
    assert quad.coef[0] == pytest.approx(2e-7, rel=1e-6)
    noisy = polyfit(x, x + np.random.default_rng(0).normal(0, 3000, len(x)), 1)
    assert noisy.r2 < 1.0
    with pytest.raises(ValueError):
        polyfit([1, 2], [1, 2], 2)


def test_dominant_period_finds_a_planted_oscillation_and_none_in_a_ramp():
    t = np.arange(0, 5, 0.02)  # 50 Hz for 5 s
    trace = 1e9 + 3e8 * np.sin(2 * np.pi * t / 0.237) + 1e7 * t
    osc = dominant_period(t, trace)
    assert osc.period_s == pytest.approx(0.237, abs=0.02)
    assert osc.amplitude == pytest.approx(6e8, rel=0.05)
    flat = dominant_period(t, 1e9 + 1e7 * t)
    assert flat.period_s is None and flat.amplitude < 1e3


def test_dominant_period_survives_repeated_timestamps():
    """A loaded machine's sampler can record the same rounded time more than once (CI hit this)."""
    t = np.repeat(np.arange(0, 2, 0.02), 3).round(4)
    osc = dominant_period(t, np.sin(2 * np.pi * t / 0.25))
    assert osc.period_s == pytest.approx(0.25, rel=0.1)
    few = dominant_period([0.0] * 6 + [0.1, 0.1], [1.0] * 8)
    assert few.period_s is None


def test_nvml_index_follows_the_visible_devices(monkeypatch):
    from niah.experiments.telemetry import nvml_index

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_index(1) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # what Ray sets for an actor holding GPUs 3 and 5
    assert (nvml_index(0), nvml_index(1)) == (3, 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2e")
    assert nvml_index(0) == "GPU-8f2e"


def test_the_cpu_record_names_the_model_and_the_simd_flags_it_has():
    from niah.env import cpu_record

    info = (
        "processor\t: 0\nmodel name\t: Intel Xeon 8480+\n"
        "flags\t\t: fpu sse4_2 avx avx2 fma avx512f amx_tile amx_bf16\n\n"
    )
    rec = cpu_record(info + info.replace("processor\t: 0", "processor\t: 1"))
    assert rec["cpu"] == "Intel Xeon 8480+"
    assert rec["cpu_simd"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "amx_tile", "amx_bf16"]
    arm = cpu_record("Features\t: fp asimd sve\nCPU implementer\t: 0x41\n")
    assert arm["cpu_simd"] == ["asimd", "sve"] and arm["cpu"]  # no model name line: the platform's processor name
    assert cpu_record("")["cpu_simd"] == [] and isinstance(cpu_record("")["torch_cpu_capability"], str)
