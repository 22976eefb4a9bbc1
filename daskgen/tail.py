"""The tail share of a run: the fraction of its generating time spent committing its last 10 % of prompts.

A job ends with its slowest partition; the tail share says how much that cost (length-aware dispatch,
:mod:`daskgen.client.dispatch`, exists to shrink it).  The run's closing line and run history
(:mod:`daskgen.client.run_summary`, from the store's commit times) and the dashboard page
(:mod:`daskgen.dashboard.state`, from the committed-prompt series the client reports) both compute it here.
"""

from __future__ import annotations

import math

import numpy as np

#: The tail is the last this fraction of a run's committed prompts.
TAIL_FRACTION = 0.10
#: Fewer committed prompts than this have no tail share.
MIN_PROMPTS = 10


def series_tail_share(times: np.ndarray, prompts: np.ndarray, since: float) -> float | None:
    """The tail share of a run that started generating at ``since`` (Unix time), from ``prompts[i]``: the
    prompts it had committed by ``times[i]`` (both ascending); ``None`` with fewer than :data:`MIN_PROMPTS`."""
    if not len(times) or prompts[-1] < MIN_PROMPTS:
        return None
    n = prompts[-1]
    end = times[np.argmax(prompts >= n)]  # the commit that reached the latest count
    cut = times[np.argmax(prompts > math.floor((1 - TAIL_FRACTION) * (n - 1)))]
    return float((end - cut) / (end - since)) if end > since else 0.0


def tail_share(committed_at: np.ndarray, since: float) -> float | None:
    """The tail share from each prompt's commit time (``NaN``: not committed; times before ``since`` belong to
    earlier runs and are left out)."""
    times = np.sort(committed_at[np.isfinite(committed_at) & (committed_at >= since)])
    return series_tail_share(times, np.arange(1, len(times) + 1), since)
