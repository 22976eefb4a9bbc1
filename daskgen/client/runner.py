"""The client side of a run: validate input, prepare the store, drive partitions, commit.

Partitions stream through ``as_completed`` with a bounded in-flight window; each finished
partition is committed (``status`` written after its data, :mod:`daskgen.client.commit`) and its future
released.

Retry and failure policy
------------------------
Implemented here (:func:`drive` and its helpers) with :mod:`daskgen.worker.partition` and
:mod:`daskgen.worker.plugin`; from the first response to a failure to the last:

1. **Task retries.**  A partition task that raises (an engine exception, or rows not finished
   within ``partition_timeout_s``) is retried by Dask up to ``max_retries`` times (default 2;
   :func:`_submit`), possibly on another worker.  Rewriting the partition's chunk-aligned region
   is idempotent.  A sample the engine answers with an error (a bad request) fails its row at
   once, without a retry.
2. **Row isolation.**  A partition that still fails is resubmitted once in ``isolate`` mode (no
   Dask retries): row by row, and a row that fails alone is committed ``failed`` with its error,
   so one poison prompt cannot sink its partition (:func:`_collect`).
3. **Engine restart.**  Before the task fails, the worker's :class:`~daskgen.worker.plugin.EnginePlugin`
   restarts the engine in place: after an engine exception (``mark_broken``), or after a timeout
   when a one-token health check fails (``check_health``).  A worker whose restart fails withdraws
   its ``daskgen-engine`` resource and takes no more partitions; when every worker's engine has
   failed the run stops with each worker's error (:func:`daskgen.client.engines.check_engines`).
4. **Requeue of aborted rows.**  Rows that came back ``abort`` while the run is not stopping
   (their engine was restarted under them, or their worker was drained before leaving) are
   requeued at once, restricted to those rows (:func:`_only_rows`); the stored tokens of their
   aborted samples are kept and continued.  A row aborted more than ``daskgen.abort-requeue-limit``
   times (default 10) in one run is committed ``failed`` with a message saying so
   (:func:`_requeue_aborted`); its stored tokens stay, and ``--retry-failed`` continues it.  During a
   stop (target, budget, deadline, SIGTERM) aborted rows are not requeued: they stay pending for the next run.
5. **``--retry-failed``.**  Rows committed ``failed`` stay failed on resume unless the run is
   started again with ``--retry-failed`` (:func:`daskgen.client.plan.pending_rows`).

A store write error (:class:`~daskgen.errors.StoreWriteError`) is not retried: the run stops,
keeping every partition committed before it.  The tested cases: ``docs/reliability.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.client.commit import CommitBatch, Outcome, commit_overlong
from daskgen.client.dispatch import still_partial
from daskgen.client.finished import FinishedPartitions
from daskgen.client.interrupt import Interrupt, allocation_end
from daskgen.client.live import LiveRun, StopControl
from daskgen.client.plan import Plan, keep_scan, pending_rows, pending_tasks, prepare
from daskgen.client.progress import Progress
from daskgen.client.run_summary import RunSummary, summarize
from daskgen.client.stopping import abandon, begin_stop, check_interrupt, housekeeping, stop_reason, wait_s
from daskgen.client.windows import WindowBoard
from daskgen.config import RunConfig
from daskgen.errors import RunInterrupted, StoreWriteError
from daskgen.redaction import redact
from daskgen.store.layout import PENDING
from daskgen.worker.partition import PartitionResult, PartitionTask, run_partition
from daskgen.worker.plugin import RESOURCE

logger = logging.getLogger(__name__)


def run(
    config: RunConfig, prompts: str | Path | Sequence[Any] | None = None, *, handle_signals: bool = True
) -> RunSummary:
    """Run (or resume) generation for ``config``; returns the summary of the whole store.

    With ``handle_signals`` (main thread only) SIGTERM/SIGINT and the end of the SLURM allocation
    stop the run gracefully within ``config.grace`` (see :mod:`daskgen.client.interrupt`); the summary's
    ``interrupted`` then says why.
    """
    t0 = time.perf_counter()
    with Interrupt(config.grace_seconds(), install=handle_signals) as interrupt:
        plan = prepare(config, prompts)
        stop = StopControl(interrupt, allocation_end() if handle_signals else None)
        return _run_locked(plan, stop, t0)


def _run_locked(plan: Plan, stop: StopControl, t0: float) -> RunSummary:
    from daskgen.client.cluster import connect
    from daskgen.store.lock import StoreLock

    with StoreLock(plan.store.location) as lock:
        if lock.took_over:
            logger.warning("took over the stale lock of a dead run: %s", lock.took_over)
        run = _start_live(plan, stop, lock)
        generated, tokens = 0, 0
        n_pending = int(pending_rows(plan, run.status).sum())
        try:
            if n_pending and stop.interrupted() is None:
                with connect(plan.config) as (client, info):
                    tasks = pending_tasks(plan, run.status)
                    generated, tokens = drive(client, run, tasks, info, n_pending)
        except RunInterrupted:  # stopped while the engines were starting: nothing was in flight
            pass
        _record_partial_partitions(run)
        summary = summarize(run, generated, tokens, time.perf_counter() - t0)
        plan.store.append_run(summary.__dict__)
    return summary


def _start_live(plan: Plan, stop: StopControl, lock: Any) -> LiveRun:
    """Under the lock: re-read the store, bring it up to date, commit overlong prompts; the live run."""
    store = plan.store
    store.refresh_attrs()  # from here on, only this client writes them
    committed_at = store.read_region(0, plan.layout.n_prompts, ("committed_at",))["committed_at"]
    run = LiveRun(plan, store.read_status(), committed_at, stop, lock)
    store.add_missing_arrays()
    keep_scan(plan)
    commit_overlong(run)
    return run


def _record_partial_partitions(run: LiveRun) -> None:
    """Keep the partitions that hold partial responses in the attrs, for the next run to start with."""
    plan = run.plan
    size = plan.layout.partition_size
    pending = {int(r) - int(r) % size for r in np.flatnonzero(run.status == PENDING)}
    keep = still_partial(plan.first_partitions, run.partial_starts, pending)
    if keep != sorted(plan.first_partitions):
        plan.store.update_attrs(partial_partitions=keep)


def drive(
    client: Any, run: LiveRun, tasks: Iterator[PartitionTask], info: Any = None, n_pending: int = 0
) -> tuple[int, int]:
    """Stream partitions through the cluster and commit each as it finishes.

    As many partitions are in flight as the ready workers admit together (their windows,
    :mod:`daskgen.worker.admission`; on an adaptive cluster at least enough to keep ``max_workers`` busy so
    the cluster scales up), at most ``max_prompts_in_memory`` prompts' worth.

    Failures are handled as the module docstring's retry and failure policy says.
    """
    from daskgen.client.engines import check_engines, start_engines

    plan = run.plan
    start_engines(client, plan.config, run.stop.interrupt)
    _record_engine(client, plan)
    run.generating()
    retry: list[PartitionTask] = []
    done = FinishedPartitions(
        on_wait=lambda: housekeeping(client, run, tasks, retry),
        check_engines=lambda: check_engines(client, plan.config),
    )
    board = WindowBoard(client, RESOURCE, on_change=done.wake)  # a worker admitting more ends the wait at once
    board.refresh()
    futures: dict[Any, PartitionTask] = {}
    generated = tokens = 0
    refreshed, refresh_every = time.monotonic(), tunables.seconds("cap-refresh-interval")
    batch = CommitBatch(run)
    try:
        with Progress(n_pending, enabled=plan.config.progress) as bar:
            while True:
                if time.monotonic() - refreshed > refresh_every:  # workers joined/left
                    board.refresh()
                    refreshed = time.monotonic()
                cap = in_flight_target(plan, board, info)
                _submit_up_to(client, run, cap, tasks, retry, futures, done, board)
                if not futures:
                    break
                if run.stop.grace_over():
                    abandon(client, futures)
                    break
                bar.in_flight = f"{len(futures)}/{cap}"
                run.note_in_flight(sum(len(t.rows) for t in futures.values()))
                g, t = _collect_ready(run, done, futures, retry, bar, batch, board)
                generated, tokens = generated + g, tokens + t
                batch.flush(force=run.stop.stopping or not futures)
                if not run.stop.stopping and (reason := stop_reason(run, tokens)):
                    begin_stop(client, run, reason, tasks, retry)
                check_interrupt(client, run, tasks, retry)
    finally:  # a StoreWriteError stops the run: what finished before it is still committed
        batch.flush(force=True)
        board.close()
    return generated, tokens


def _submit_up_to(
    client: Any,
    run: LiveRun,
    cap: int,
    tasks: Iterator[PartitionTask],
    retry: list,
    futures: dict[Any, PartitionTask],
    done: FinishedPartitions,
    board: WindowBoard,
) -> None:
    """Submit partitions (retries first) to the workers with free admitted slots, at most ``cap`` in
    flight; beyond the workers' slots (an adaptive cluster scaling up) to any worker.  The partitions
    bound for one worker go in one ``Client.map``: one graph update for the scheduler, not one each."""
    batches: dict[tuple[str | None, bool], list[tuple[str, PartitionTask]]] = {}
    in_flight = len(futures)
    while in_flight < cap:
        worker = board.pick()
        if worker is None and in_flight >= max(1, board.total()):  # one always goes: the run must not end
            break  # while no worker admits anything (every worker draining, a replacement job starting)
        task = None if run.stop.stopping else retry.pop() if retry else next(tasks, None)
        if task is None:
            break
        key = _task_key(task)
        board.assign(key, worker)
        batches.setdefault((worker, task.isolate), []).append((key, task))
        in_flight += 1
    for (worker, isolate), group in batches.items():
        keys, group_tasks = [k for k, _ in group], [t for _, t in group]
        for fut, task in zip(
            _submit(client, keys, group_tasks, 0 if isolate else run.plan.config.max_retries, worker),
            group_tasks,
            strict=True,
        ):
            futures[fut] = task
            done.add(fut)


def _collect_ready(
    run: LiveRun,
    done: FinishedPartitions,
    futures: dict[Any, PartitionTask],
    retry: list,
    bar: Progress,
    batch: CommitBatch,
    board: WindowBoard,
) -> tuple[int, int]:
    """Wait for finished partitions and queue all that are ready for the next commit.

    Returns the prompts and response tokens they generated.
    """
    generated = tokens = 0
    outcomes: list[Outcome] = []
    try:
        for fut, value in done.wait(list(futures), min(wait_s(run), batch.due_in())):
            task = futures.pop(fut, None)
            if task is None:  # delivered late after being fetched directly
                continue
            board.release(fut.key)
            result = _collect(fut, value, task)
            fut.release()
            if result is None:  # retried enough as a whole: retry its rows one by one
                retry.append(dataclasses.replace(task, isolate=True))
                continue
            given_up: dict[int, str] = {}
            if result.aborted and not run.stop.stopping:  # aborted by an engine restart or a drain, not a stop
                again, given_up = _requeue_aborted(run, result.aborted)
                if again:
                    retry.append(_only_rows(task, again))
            finished = [r for r in result.rows if r not in result.failed and r not in result.aborted]
            failed = {r: m for r, m in result.failed.items() if r not in result.aborted} | given_up
            outcomes.append(Outcome(task.start, task.stop, finished, failed, result.notes))
            generated += len(finished) + len(failed)
            tokens += result.response_tokens
            run.count_result(result)
            bar.update(len(finished) + len(failed), result.response_tokens, len(failed))
    finally:
        batch.add(outcomes)
    return generated, tokens


def _requeue_aborted(run: LiveRun, rows: list[int]) -> tuple[list[int], dict[int, str]]:
    """Split aborted rows into those requeued again and those aborted too often (row -> error)."""
    limit = int(tunables.get("abort-requeue-limit"))
    again, given_up = [], {}
    for r in rows:
        times = run.count_abort(r)
        if times <= limit:
            again.append(r)
        else:
            given_up[r] = (
                f"aborted {times} times in this run (its engine restarted or its worker left "
                f"each time; daskgen.abort-requeue-limit is {limit}); its stored tokens are kept: "
                "rerun with --retry-failed to continue it"
            )
    if given_up:
        logger.warning(
            "%d row(s) aborted more than %d times are committed failed (first: row %d)",
            len(given_up),
            limit,
            min(given_up),
        )
    return again, given_up


def in_flight_target(plan: Plan, board: WindowBoard, info: Any = None) -> int:
    """Partitions to keep submitted: the sum of the windows the workers admit (on an adaptive
    cluster at least enough to make it scale to ``max_workers``), capped by ``max_prompts_in_memory``."""
    cap = board.total()
    if info is not None and info.adaptive:
        cap = max(cap, info.in_flight_window)
    return max(1, min(cap, plan.config.max_prompts_in_memory // plan.layout.partition_size))


def _only_rows(task: PartitionTask, rows: list[int]) -> PartitionTask:
    """The same partition restricted to ``rows`` (the other rows' stored data is kept)."""
    keep = [i for i, r in enumerate(task.rows) if r in set(rows)]
    meta = None if task.rows_meta is None else [task.rows_meta[i] for i in keep]
    prompts = None if task.prompts is None else [task.prompts[i] for i in keep]
    inputs = None if task.inputs is None else [task.inputs[i] for i in keep]
    return dataclasses.replace(task, rows=[task.rows[i] for i in keep], prompts=prompts, rows_meta=meta, inputs=inputs)


def _record_engine(client: Any, plan: Plan) -> None:
    """Store what the engine says about itself (e.g. ``retokenized`` for chat/completions servers)."""
    from daskgen.worker.plugin import engine_description

    described = [d for d in client.run(engine_description).values() if d]
    if described:
        plan.store.update_attrs(engine=redact(described[0]))


def _task_key(task: PartitionTask) -> str:
    """A fresh Dask key for one attempt at ``task`` (its mode and first row, for the dashboard and logs)."""
    return f"daskgen-{'isolated' if task.isolate else 'partition'}-{task.start}-{time.time_ns()}"


def _submit(
    client: Any, keys: list[str], tasks: list[PartitionTask], retries: int, worker: str | None = None
) -> list[Any]:
    """Submit partitions under ``keys`` in one graph; to ``worker`` when given (loosely: elsewhere if that
    worker is gone)."""
    where = {} if worker is None else {"workers": [worker], "allow_other_workers": True}
    return client.map(run_partition, tasks, key=keys, pure=False, retries=retries, resources={RESOURCE: 1}, **where)


def _collect(fut: Any, value: Any, task: PartitionTask) -> PartitionResult | None:
    """The partition's result; ``None`` to retry it row by row; all rows failed if that failed too.

    ``value`` is what ``as_completed(with_results=True, raise_errors=False)`` gave: the result, the
    ``(type, exception, traceback)`` of a failed task, or the exception of a cancelled one.
    """
    try:
        if fut.status == "error" and isinstance(value, tuple):
            raise value[1]
        if isinstance(value, Exception):
            raise value
        if not isinstance(value, PartitionResult):
            raise RuntimeError(f"task ended {fut.status!r}: {value!r}")
        return value
    except StoreWriteError:
        raise  # the disk is the problem, not the prompts: stop the run, keep what is committed
    except Exception as exc:
        logger.error(
            "partition %d-%d failed%s: %s",
            task.start,
            task.stop,
            " in isolated mode" if task.isolate else " after retries",
            exc,
        )
        if not task.isolate and len(task.rows) > 1:
            return None
        msg = f"partition failed after retries: {type(exc).__name__}: {exc}"
        return PartitionResult(task.start, task.stop, list(task.rows), failed={r: msg for r in task.rows})


def generate(prompts: str | Path | Sequence[Any], *, model: str, store: str | Path, **options: Any):
    """Generate (or resume) into ``store`` and return it as an ``xarray.Dataset``.

    ``prompts`` is a JSONL/Parquet path or a list of rows (dicts with ``messages`` or
    ``prompt``, or plain strings).  ``options`` are :class:`RunConfig` fields.
    """
    from daskgen.analysis.accessor import open_store

    source = None if isinstance(prompts, (str, Path)) else prompts
    config = RunConfig.from_dict(
        {**options, "model": str(model), "store": str(store), "prompts": str(prompts) if source is None else None},
        source="generate()",
    )
    summary = run(config, source)
    if summary.interrupted:
        raise RunInterrupted(f"{summary.line()}")
    return open_store(config.location())
