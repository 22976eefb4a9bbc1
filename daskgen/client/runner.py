"""Running (or resuming) a generation: plan, lock, live run, cluster, stream, summary.

:func:`run` prepares the plan (:mod:`daskgen.client.plan`), takes the store's lock, starts the live run
(:mod:`daskgen.client.live`), connects to a cluster (:mod:`daskgen.client.cluster`) and streams the
pending partitions through it (:mod:`daskgen.client.driver`, which also holds the retry and failure
policy); each finished partition is committed (``status`` written after its data,
:mod:`daskgen.client.commit`).  The summary of the whole store closes the run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.client import driver
from daskgen.client.commit import commit_overlong
from daskgen.client.dispatch import still_partial
from daskgen.client.interrupt import Interrupt, allocation_end
from daskgen.client.live import LiveRun, StopControl
from daskgen.client.plan import Plan, make_plan, pending_rows, pending_tasks
from daskgen.client.requeue import take_requeued
from daskgen.client.run_summary import RunSummary, summarize
from daskgen.config import RunConfig
from daskgen.declare import takes_options
from daskgen.errors import RunInterrupted
from daskgen.gc_tuning import CLIENT, collector_tuned
from daskgen.run_options import RunCommand, RunOptions
from daskgen.settings import resolve
from daskgen.store.commit_log import read_head
from daskgen.store.layout import PENDING

logger = logging.getLogger(__name__)


def run(
    config: RunConfig,
    prompts: str | Path | Sequence[Any] | None = None,
    *,
    handle_signals: bool = True,
    then_exit: bool = False,
    command: RunCommand | None = None,
) -> RunSummary:
    """Run (or resume) generation for ``config``; returns the summary of the whole store.

    With ``handle_signals`` (main thread only) SIGTERM/SIGINT and the end of the SLURM allocation
    stop the run gracefully within ``config.grace`` (see :mod:`daskgen.client.interrupt`); the summary's
    ``interrupted`` then says why.  ``then_exit``: the caller ends its process once the run returns (the
    ``daskgen run`` command), so from the run's end on a SIGTERM is ignored: everything is committed, the
    process shuts down cleanly and exits with the run's status.  ``command``: the flags of ``daskgen run`` that
    are no settings (its cluster kind and ``--insecure`` are merged into the cluster section).
    """
    t0 = time.perf_counter()
    with Interrupt(install=handle_signals, ignore_sigterm_after=then_exit) as interrupt:
        settings = resolve(config, prompts, command=command)
        interrupt.grace_s = settings.grace_s  # a stop asked for while planning has nothing in flight to wait for
        plan = make_plan(settings)
        stop = StopControl(interrupt, allocation_end() if handle_signals else None)
        return _run_locked(plan, stop, t0)


def _run_locked(plan: Plan, stop: StopControl, t0: float) -> RunSummary:
    from daskgen.client.cluster import connect

    with _live(plan, stop) as run:
        n_pending = int(pending_rows(plan, run.status).sum())
        try:
            if n_pending and stop.interrupted() is None:
                with connect(plan.settings, stop.interrupt) as (client, info), collector_tuned(CLIENT):
                    tasks = pending_tasks(plan, run.status)
                    driver.drive(client, run, tasks, info, n_pending)
        except RunInterrupted as exc:  # stopped while the cluster or the engines started, or the scheduler was lost
            if stop.interrupt is not None:
                stop.interrupt.request(str(exc))  # the first reason wins: a signal's, if one came first
        _record_partial_partitions(run)
        summary = summarize(run, time.perf_counter() - t0)
        plan.store.append_run(summary.__dict__)
    return summary


@contextlib.contextmanager
def _live(plan: Plan, stop: StopControl) -> Iterator[LiveRun]:
    """The live run, while this client holds the store's lock: the store re-read and brought up to date, a fresh
    input scan kept in its attrs, the overlong prompts committed and the rows followers sent back taken."""
    from daskgen.store.records.lock import StoreLock

    store = plan.store
    with StoreLock(store.location) as lock:
        if lock.took_over:
            logger.warning("took over the stale lock of a dead run: %s", lock.took_over)
        store.refresh_attrs()  # from here on, only this client writes them
        store.add_missing_arrays()
        if plan.scan_record is not None:  # a fresh scan of an existing store (the plan keeps no attrs itself)
            store.update_attrs(input_scan=plan.scan_record)
        record = store.read_region(0, plan.layout.n_prompts, ("committed_at", "commit_seq"))
        seq = record["commit_seq"].astype("int64")
        last = max(int(seq.max(initial=0)), read_head(store.location))
        run = LiveRun(plan, store.read_status(), record["committed_at"], seq, last, stop, lock)
        commit_overlong(run)
        take_requeued(run)
        yield run


def _record_partial_partitions(run: LiveRun) -> None:
    """Keep the partitions that hold partial responses in the attrs, for the next run to start with."""
    plan = run.plan
    pending = set(plan.layout.partitions_of(np.flatnonzero(run.status == PENDING)))
    keep = still_partial(plan.first_partitions, run.partial_starts, pending)
    if keep != sorted(plan.first_partitions):
        plan.store.update_attrs(partial_partitions=keep)


@takes_options(RunOptions)
def generate(prompts: str | Path | Sequence[Any], **options: Any) -> Any:
    """Generate (or resume) into ``store`` and return it as an ``xarray.Dataset``.

    The keyword arguments are the run options (:class:`daskgen.run_options.RunOptions`, the keys of a
    ``daskgen run --config`` file); ``model`` and ``store`` are required.

    Parameters
    ----------
    prompts:
        A JSONL/Parquet path or a list of rows (dicts with ``messages`` or ``prompt``, or plain strings).

    Returns
    -------
    xarray.Dataset
        The whole store (:func:`daskgen.open_store`).
    """
    from daskgen.analysis.accessor import open_store

    source = None if isinstance(prompts, (str, Path)) else prompts
    paths = {"model": str(options["model"]), "store": str(options["store"])}
    config = RunConfig.from_dict(
        {**options, **paths, "prompts": str(prompts) if source is None else None}, source="generate()"
    )
    summary = run(config, source)
    if summary.interrupted:
        raise RunInterrupted(f"{summary.line()}")
    return open_store(config.location())
