"""Least-squares fits of measured latencies (pure: numbers in, coefficients out)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearFit:
    """y ≈ slope·x + intercept, and how well that holds."""

    slope: float
    intercept: float
    residual: float  # relative RMS error of the fit (see relative_rms)

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


def relative_rms(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """RMS of (predicted - measured), relative to the mean measurement: 0.05 is "off by ~5%"."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    if p.shape != m.shape or m.size == 0:
        raise ValueError(f"need as many predictions as measurements (got {p.size} and {m.size}), at least one")
    scale = float(np.mean(np.abs(m)))
    rms = float(np.sqrt(np.mean((p - m) ** 2)))
    return rms / scale if scale > 0 else (0.0 if rms == 0 else math.inf)


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least squares y = a·x + b with a, b >= 0.

    A latency cannot fall as the context grows, nor be negative with an empty one; a
    noisy, flat curve would otherwise fit a negative slope that a DP then trusts at
    long contexts. If the free fit breaks a bound, the optimum of this convex problem
    lies on that bound, so the better of the two one-parameter fits is the answer.
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"need matching 1-D samples, got {x.shape} and {y.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("cannot fit non-finite samples")
    if np.unique(x).size < 2:
        # One context length determines no slope: a constant is all the data says.
        return _fit(x, y, 0.0, float(np.mean(y)))
    design = np.stack([x, np.ones_like(x)], axis=1)  # [num_samples, 2]
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    if a >= 0 and b >= 0:
        return _fit(x, y, float(a), float(b))
    candidates = [_fit(x, y, 0.0, max(float(np.mean(y)), 0.0))]
    sum_xx = float(np.dot(x, x))
    if sum_xx > 0:
        candidates.append(_fit(x, y, max(float(np.dot(x, y)) / sum_xx, 0.0), 0.0))
    return min(candidates, key=lambda fit: fit.residual)


def _fit(x: np.ndarray, y: np.ndarray, slope: float, intercept: float) -> LinearFit:
    return LinearFit(slope, intercept, relative_rms(slope * x + intercept, y))
