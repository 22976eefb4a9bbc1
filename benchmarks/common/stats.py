"""Intervals for side-by-side ratios: how far the repeats of one comparison let its figure move."""

from __future__ import annotations

from collections.abc import Sequence

#: Bootstrap resamples of :func:`bootstrap_interval` (enough for a stable 95 % interval of a mean).
RESAMPLES = 10_000


def bootstrap_interval(values: Sequence[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (``level`` coverage, seeded resampling).

    Each resample draws ``len(values)`` values with replacement and takes their mean; the interval is the
    central ``level`` share of those means.  NaNs when fewer than two values.
    """
    import numpy as np

    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return float("nan"), float("nan")
    draws = np.random.default_rng(seed).integers(0, data.size, size=(RESAMPLES, data.size))
    means = data[draws].mean(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
