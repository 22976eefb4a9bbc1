"""Small statistics helpers of the accessor: time bins, counts per key, quantiles of counts, pass@k."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import xarray as xr

NICE_BINS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400)


def epoch_seconds(times: xr.DataArray) -> xr.DataArray:
    """Seconds since 1970 as floats (NaN where unset), from decoded datetimes or raw floats."""
    if np.issubdtype(times.dtype, np.datetime64):
        return (times - np.datetime64("1970-01-01T00:00:00", "ns")) / np.timedelta64(1, "s")
    return times.astype("float64")


def nice_bin_seconds(span: float, target_bins: int = 30) -> float:
    """A round bin width (1 s, 2 s, 5 s, ... 1 day) giving about ``target_bins`` bins over ``span``."""
    want = max(span / target_bins, 1.0)
    return float(next((b for b in NICE_BINS if b >= want), math.ceil(want / 86400) * 86400))


def bincount(keys: xr.DataArray, length: int, weights: xr.DataArray | None = None) -> np.ndarray:
    """Counts (or weight sums) of the integer ``keys`` in ``[0, length)``, computed chunk by chunk."""
    import dask.array as da

    if weights is not None:
        keys, weights = xr.broadcast(keys, weights)
        keys, weights = xr.unify_chunks(keys, weights)
    k = da.asarray(keys.data).astype("int64").ravel()
    w = None if weights is None else da.asarray(weights.data).astype("float64").ravel()
    return np.asarray(da.bincount(k, weights=w, minlength=length).compute())[:length]


def quantile(cumulative: np.ndarray, total: int, q: float) -> int:
    """Lower ("inverted CDF") quantile of a histogram given its cumulative counts."""
    return int(np.searchsorted(cumulative, max(math.ceil(q * total), 1)))


def per_sample(flags: xr.DataArray) -> xr.DataArray:
    """Reduce a per-sample flag over any axis beyond (prompt, sample), e.g. ``trajectory``: any."""
    extra = [d for d in flags.dims if d not in ("prompt", "sample")]
    return flags.any(extra) if extra else flags


def pass_at_k(used: np.ndarray, hits: np.ndarray, k: int) -> float:
    """Mean unbiased pass@k, 1 - C(n-c, k) / C(n, k), over prompts with n >= k generated samples."""
    ok = used >= k
    if not ok.any():
        return float("nan")
    pairs, inverse = np.unique(np.stack([used[ok], hits[ok]]), axis=1, return_inverse=True)
    values = np.array([1 - math.comb(int(n) - int(c), k) / math.comb(int(n), k) for n, c in pairs.T])
    return float(values[inverse.ravel()].mean())


def histogram_row(counts: np.ndarray, quantiles: Sequence[float]) -> dict[str, float]:
    total = int(counts.sum())
    lengths = np.arange(len(counts))
    present = np.flatnonzero(counts)
    cumulative = np.cumsum(counts)
    row: dict[str, float] = {
        "samples": total,
        "mean": float((lengths * counts).sum() / total),
        "min": int(present[0]),
        "max": int(present[-1]),
    }
    for q in quantiles:
        row[f"p{q * 100:g}"] = quantile(cumulative, total, q)
    return row
