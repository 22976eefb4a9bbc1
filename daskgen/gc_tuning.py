"""A daskgen process's garbage collector: what it has loaded is frozen, and young objects are collected less often.

A worker makes a dozen short-lived container objects per sample (requests, results, futures); the client, with
the scheduler of a local cluster in its process, a few per partition, beside everything it planned (the input
scan, the tokenizer).  With CPython's defaults a collection of the youngest generation runs every 700 allocations,
the objects it finds alive move to older generations, and every so often a full collection scans them again
together with everything the process loaded: on the instant engine a worker spent 13.9-23.7 µs of CPU per sample in
the collector, 2.6-5.2 µs with the freeze and a threshold of 10,000, and 0.0-1.3 µs with the default 50,000; the
client of a one-run process about 4 µs, none with the freeze (``docs/hpc.md``).

:func:`tune_collector` moves every object alive then into the collector's permanent generation (``gc.freeze``:
never scanned again) and raises the youngest generation's threshold, as a ``daskgen:`` config section says
(``worker-gc``: a worker, once its engine has started; ``client-gc``: the client, while a run streams, see
:func:`collector_tuned`).  Most per-sample objects are then freed by reference counting before any collection sees
them.  Cycles are still collected, only less often.  :func:`thaw_collector` makes the frozen objects collectable
again (a worker's engine shut down, a run ended), so their cycles are freed.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from daskgen import tunables
from daskgen.errors import ConfigError

#: The config sections of the processes that tune their collector.
WORKER, CLIENT = "worker-gc", "client-gc"


def collector_settings(section: str = WORKER) -> tuple[bool, int]:
    """``daskgen.<section>.freeze`` and ``daskgen.<section>.threshold``, checked."""
    freeze, threshold = tunables.get(f"{section}.freeze"), tunables.get(f"{section}.threshold")
    env = f"DASK_DASKGEN__{section.upper().replace('-', '_')}"
    where = "the workers' environment" if section == WORKER else "the client's environment"
    if not isinstance(freeze, bool):
        raise ConfigError(
            f"daskgen.{section}.freeze must be true or false, found {freeze!r}; set e.g. {env}__FREEZE=false in {where}"
        )
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigError(
            f"daskgen.{section}.threshold must be an integer >= 0 (0: Python's own threshold), found {threshold!r}; "
            f"set e.g. {env}__THRESHOLD=50000 in {where}"
        )
    return freeze, threshold


def tune_collector(section: str = WORKER) -> None:
    """Freeze what this process holds now and raise the youngest generation's threshold, as ``section`` says."""
    freeze, threshold = collector_settings(section)
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


@contextlib.contextmanager
def collector_tuned(section: str) -> Iterator[None]:
    """:func:`tune_collector` for the block; afterwards the thresholds are Python's again and what was frozen is
    collectable (left to the collector's next full pass: the process goes on, e.g. a notebook)."""
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    tune_collector(section)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        if not frozen_before:  # a process that froze objects itself keeps them frozen
            gc.unfreeze()
