"""Lloyd-Max scalar codebooks for one coordinate of a uniformly random unit vector (TurboQuant).

After a Haar-random rotation, each coordinate ``t`` of a unit vector in ``R^d`` has the density (TurboQuant, arXiv
2504.19874, Lemma 1)

    f_d(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - t^2)^((d-3)/2),   t in [-1, 1],

i.e. ``(t + 1) / 2 ~ Beta((d-1)/2, (d-1)/2)``.  The codebook for ``b`` bits is the ``2^b``-level Lloyd-Max
quantizer of that density, computed exactly rather than sampled (docs/design-notes.md#niah.kv.codebooks), once per
``(d, b)``: cached in-process and on disk as plain ``.npy`` float64 arrays under ``~/.cache/niah/codebooks``
(``$NIAH_CACHE`` overrides ``~/.cache/niah``; ``NIAH_CODEBOOK_DISK_CACHE=0`` turns the disk cache off), read with
``allow_pickle=False``.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from pathlib import Path

import numpy as np
from scipy.special import betainc, gammaln, ndtri

_VERSION = 1  # bump if the algorithm changes, so stale disk files are not reused


def coordinate_density(t: np.ndarray, d: int) -> np.ndarray:
    """``f_d(t)``: density of one coordinate of a uniform unit vector in ``R^d`` (Lemma 1)."""
    t = np.asarray(t, dtype=np.float64)
    logc = gammaln(d / 2) - 0.5 * math.log(math.pi) - gammaln((d - 1) / 2)
    inside = np.clip(1.0 - t * t, 0.0, None)
    with np.errstate(divide="ignore"):
        return np.where(np.abs(t) < 1, np.exp(logc + (d - 3) / 2 * np.log(inside)), 0.0)


def _cdf(t: np.ndarray, d: int) -> np.ndarray:
    a = (d - 1) / 2
    return betainc(a, a, np.clip((np.asarray(t, dtype=np.float64) + 1) / 2, 0.0, 1.0))


def _first_moment_antideriv(t: np.ndarray, d: int) -> np.ndarray:
    """``F1(t)`` with ``F1' = t f_d(t)``: ``-C_d/(d-1) (1-t^2)^((d-1)/2)``."""
    logc = gammaln(d / 2) - 0.5 * math.log(math.pi) - gammaln((d - 1) / 2)
    inside = np.clip(1.0 - np.asarray(t, dtype=np.float64) ** 2, 0.0, None)
    return -np.exp(logc) / (d - 1) * inside ** ((d - 1) / 2)


def _cells(bounds: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Mass and first moment of each cell between consecutive ``bounds`` (which start at -1, end at 1)."""
    mass = np.diff(_cdf(bounds, d))
    moment = np.diff(_first_moment_antideriv(bounds, d))
    return mass, moment


def _lloyd_max(d: int, bits: int, tol: float = 1e-13, max_iter: int = 100_000) -> np.ndarray:
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(d)
    # start from uniform-in-probability quantiles of N(0, 1/d), clipped into (-1, 1)
    c = np.clip(ndtri((np.arange(levels) + 0.5) / levels) * sigma, -0.999, 0.999)
    for _ in range(max_iter):
        bounds = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
        mass, moment = _cells(bounds, d)
        new = moment / np.maximum(mass, 1e-300)
        new = (new - new[::-1]) / 2  # the density is even: keep the codebook exactly symmetric
        if np.max(np.abs(new - c)) < tol * sigma:
            c = new
            break
        c = new
    return c


def _cache_dir() -> Path | None:
    if os.environ.get("NIAH_CODEBOOK_DISK_CACHE", "1") == "0":
        return None
    root = os.environ.get("NIAH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "niah")
    return Path(root) / "codebooks"


@functools.lru_cache(maxsize=None)
def lloyd_max_codebook(d: int, bits: int) -> np.ndarray:
    """Sorted, symmetric ``2^bits`` centroids (float64) for one coordinate of a unit vector in ``R^d``.

    The result is read-only; it is cached in memory and on disk (``.npy``, never pickle).
    """
    if d < 2:
        raise ValueError(f"Lloyd-Max codebook needs dimension d >= 2, got {d}")
    if not 1 <= bits <= 8:
        raise ValueError(f"Lloyd-Max codebook needs 1 <= bits <= 8, got {bits}")
    folder = _cache_dir()
    path = folder / f"sphere_lloyd_v{_VERSION}_d{d}_b{bits}.npy" if folder else None
    c = None
    if path is not None and path.is_file():
        try:
            loaded = np.load(path, allow_pickle=False)
            if loaded.shape == (1 << bits,) and loaded.dtype == np.float64 and np.all(np.diff(loaded) > 0):
                c = loaded
        except (OSError, ValueError):
            c = None
    if c is None:
        c = _lloyd_max(d, bits)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.tmp")
                with os.fdopen(fd, "wb") as fh:
                    np.save(fh, c, allow_pickle=False)
                os.replace(tmp, path)
            except OSError:
                pass  # an unwritable cache only costs recomputation
    c = np.array(c, dtype=np.float64)
    c.setflags(write=False)
    return c


def unit_vector_mse(d: int, bits: int) -> float:
    """Exact ``E||u - u_hat||^2`` for a uniform unit vector in ``R^d`` under the ``(d, bits)`` codebook."""
    c = lloyd_max_codebook(d, bits)
    bounds = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
    mass, moment = _cells(bounds, d)
    # E[(T - c)^2] per cell = E[T^2 1_cell] - 2 c moment + c^2 mass; summing E[T^2 1_cell] gives 1/d
    per_coord = 1.0 / d - float(np.sum(2 * c * moment - c * c * mass))
    return d * per_coord
