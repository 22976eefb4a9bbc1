"""A worker's garbage collector: what the worker has loaded is frozen, and young objects are collected less often.

A worker makes a dozen short-lived container objects per sample (requests, results, trajectories, futures).
With CPython's defaults a collection of the youngest generation runs every 700 allocations, the objects it finds
alive move to older generations, and every so often a full collection scans them again together with everything
the worker loaded at start (Dask, the engine, its tokenizer): on the instant engine a worker spent 13.9-23.7 µs of
CPU per sample in the collector, 2.6-5.2 µs with the freeze and a threshold of 10,000, and 0.0-1.3 µs with the
default 50,000 (``benchmarks/README.md``).  Once the engine has started, :func:`tune_collector` moves every object
then alive into the collector's permanent generation (``gc.freeze``: never scanned again) and raises the youngest
generation's threshold to ``daskgen.worker-gc.threshold``, so most per-sample objects are freed by reference
counting before any collection sees them.  Cycles are still collected, only less often.  When the engine shuts
down (before a restart, at the worker's end) :func:`thaw_collector` makes the frozen objects collectable again, so
an old engine's cycles are freed.
"""

from __future__ import annotations

import gc

from daskgen import tunables
from daskgen.errors import ConfigError


def collector_settings() -> tuple[bool, int]:
    """``daskgen.worker-gc.freeze`` and ``daskgen.worker-gc.threshold``, checked."""
    freeze, threshold = tunables.get("worker-gc.freeze"), tunables.get("worker-gc.threshold")
    if not isinstance(freeze, bool):
        raise ConfigError(
            f"daskgen.worker-gc.freeze must be true or false, found {freeze!r}; set e.g. "
            "DASK_DASKGEN__WORKER_GC__FREEZE=false in the workers' environment"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigError(
            f"daskgen.worker-gc.threshold must be an integer >= 0 (0: Python's own threshold), found {threshold!r}; "
            "set e.g. DASK_DASKGEN__WORKER_GC__THRESHOLD=50000 in the workers' environment"
        )
    return freeze, threshold


def tune_collector() -> None:
    """Freeze what this process holds now and raise the youngest generation's threshold, as configured."""
    freeze, threshold = collector_settings()
    if freeze:
        gc.freeze()
    if threshold:
        gc.set_threshold(threshold, *gc.get_threshold()[1:])


def thaw_collector() -> None:
    """Make what :func:`tune_collector` froze collectable again and collect it: called once an engine has shut down
    (before a restart, or at teardown), so that an old engine's objects held only in reference cycles (with the
    memory or devices they hold) are freed rather than kept in the permanent generation."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
