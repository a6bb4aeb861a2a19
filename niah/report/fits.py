"""Fits used by the sweep and the claims ledger: polynomial fits with R^2, and the period of a memory trace."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PolyFit:
    coef: np.ndarray  # highest power first, as numpy.polyfit returns
    r2: float

    def __call__(self, x):
        return np.polyval(self.coef, x)


def polyfit(x, y, degree: int = 1) -> PolyFit:
    """Least-squares polynomial of ``degree`` and its coefficient of determination R^2."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) <= degree:
        raise ValueError(f"a degree-{degree} fit needs more than {degree} points; got {len(x)}")
    coef = np.polyfit(x, y, degree)
    resid = y - np.polyval(coef, x)
    total = ((y - y.mean()) ** 2).sum()
    return PolyFit(coef, 1.0 - (resid**2).sum() / total if total > 0 else 1.0)


@dataclass
class Oscillation:
    period_s: float | None  # dominant period; None when the trace has no periodic part
    amplitude: float  # peak-to-trough of the detrended trace
    strength: float  # the autocorrelation at that period, in [-1, 1]


def dominant_period(times, values, min_strength: float = 0.3) -> Oscillation:
    """Dominant period of a sampled trace by autocorrelation (after removing a linear trend).

    The trace is resampled onto a uniform grid first; a period is reported only if the autocorrelation
    at its first peak reaches ``min_strength``.
    """
    t, v = np.asarray(times, float), np.asarray(values, float)
    if len(t) < 8:
        raise ValueError(f"a period needs at least 8 samples; got {len(t)}")
    t, first = np.unique(t, return_index=True)  # a busy sampler thread can repeat a (rounded) timestamp
    v = v[first]
    if len(t) < 8:
        return Oscillation(None, float(v.max() - v.min()), 0.0)
    dt = np.median(np.diff(t))
    grid = np.arange(t[0], t[-1], dt)
    u = np.interp(grid, t, v)
    u = u - np.polyval(np.polyfit(grid, u, 1), grid)
    amplitude = float(u.max() - u.min())
    if amplitude == 0:
        return Oscillation(None, 0.0, 0.0)
    ac = np.correlate(u, u, "full")[len(u) - 1 :]
    ac = ac / ac[0]
    # first local maximum after the first zero crossing
    below = np.nonzero(ac < 0)[0]
    if not len(below):
        return Oscillation(None, amplitude, 0.0)
    start = below[0]
    lag = start + int(np.argmax(ac[start : len(ac) // 2])) if start < len(ac) // 2 else None
    if lag is None or ac[lag] < min_strength:
        return Oscillation(None, amplitude, float(ac[lag]) if lag is not None else 0.0)
    return Oscillation(float(lag * dt), amplitude, float(ac[lag]))
