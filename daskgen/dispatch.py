"""Length-aware dispatch: which partitions start first, and how long the run's tail was.

A partition ends with its slowest sample, and a job ends with its slowest partition.  What is known
about lengths before generating: a partition whose responses were interrupted (a stop, a preemption,
an engine restart) holds samples that were still running when everything around them had finished —
the long ones.  Those partitions are dispatched first when a run resumes, so their continuations
overlap the rest of the job instead of forming its tail.  The client records them in the store's
attrs (:data:`ATTR`) when a run ends.

The *tail share* of a run — the fraction of its generating time spent committing the last 10 % of
its prompts — says how much the tail cost; it is printed and kept in the run history.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

#: Attribute (in the store's ``daskgen`` attrs) listing partitions that hold partial responses.
ATTR = "partial_partitions"
#: The tail is the last this fraction of a run's committed prompts.
TAIL_FRACTION = 0.10


def dispatch_order(starts: Iterable[int], first: Iterable[int]) -> tuple[list[int], list[int]]:
    """Split partition ``starts`` into (those in ``first``, the others), each ascending."""
    starts, first = sorted(set(starts)), set(first)
    return [s for s in starts if s in first], [s for s in starts if s not in first]


def still_partial(previous: Iterable[int], new: Iterable[int], pending_starts: Iterable[int]) -> list[int]:
    """Partitions to record: earlier and new ones with partial responses that still have pending rows."""
    pending = set(pending_starts)
    return sorted((set(previous) | set(new)) & pending)


def tail_share(committed_at: np.ndarray, since: float) -> float | None:
    """Fraction of the time since ``since`` (Unix time) spent committing the last 10 % of the prompts
    committed after it; ``None`` with fewer than 10 such prompts."""
    times = np.sort(committed_at[np.isfinite(committed_at) & (committed_at >= since)])
    if len(times) < 10:
        return None
    end = times[-1]
    if end <= since:
        return 0.0
    cut = times[int(np.floor((1 - TAIL_FRACTION) * (len(times) - 1)))]
    return float((end - cut) / (end - since))
