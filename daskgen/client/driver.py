"""Streaming partitions through the cluster: submit as many as the workers admit, collect, commit.

As many partitions are in flight as the ready workers admit together (their windows,
:mod:`daskgen.worker.admission`; on an adaptive cluster at least enough to keep ``max_workers`` busy so
the cluster scales up), at most ``max_prompts_in_memory`` prompts' worth.  Finished partitions come back
through ``as_completed`` (:mod:`daskgen.client.finished`) and are committed in batches
(:mod:`daskgen.client.commit`).

Retry and failure policy
------------------------
Implemented here (:class:`Driver`) with :mod:`daskgen.worker.partition` and :mod:`daskgen.worker.plugin`;
from the first response to a failure to the last:

1. **Task retries.**  A partition task that raises (an engine exception, or rows not finished
   within ``partition_timeout_s``) is retried by Dask up to ``max_retries`` times (default 2;
   :func:`submit`), possibly on another worker.  Rewriting the partition's chunk-aligned region
   is idempotent.  A sample the engine answers with an error (a bad request) fails its row at
   once, without a retry.
2. **Row isolation.**  A partition that still fails is resubmitted once in ``isolate`` mode (no
   Dask retries): row by row, and a row that fails alone is committed ``failed`` with its error,
   so one poison prompt cannot sink its partition (:func:`~daskgen.client.outcomes.collect`).
3. **Worker deaths.**  When the worker process dies under a task (a segfault, an OOM kill), Dask
   reschedules the task; after ``distributed.scheduler.allowed-failures`` + 1 such deaths (the option is
   3 by default) the task ends :class:`~distributed.scheduler.KilledWorker`.  In-process isolation cannot help then (the
   row that kills the process takes the whole task with it), so each of its rows becomes a one-row
   ``alone`` task (:func:`~daskgen.client.outcomes.split_alone`), and only one ``alone`` task is in flight at a
   time in the run
   (:meth:`Driver.next_task`; other partitions keep going).  Every other task on a dying worker is
   rescheduled with it, so running these rows one at a time is what tells the killer from its
   neighbours: a one-row ``alone`` task that ends ``KilledWorker`` again is the only row committed
   ``failed``, with an error saying how often the worker died under it (``--retry-failed`` tries it
   again); the others are generated and committed ``done`` one by one.  One row that kills its worker
   costs ``2 * (allowed-failures + 1)`` worker deaths (its partition's task, then its own), whatever
   the partition size: bisecting the partition would cost that many deaths per halving, and each
   death is an engine restart on the new worker process.  A task that dies writes nothing, so the rows
   of the killed partition are generated again (their partial responses stored before are continued).
   ``tests/test_worker_kill_prompt.py``.
4. **Engine restart.**  Before the task fails, the worker's :class:`~daskgen.worker.plugin.EnginePlugin`
   restarts the engine in place: after an engine exception (``mark_broken``), or after a timeout
   when a one-token health check fails (``check_health``).  A worker whose restart fails withdraws
   its ``daskgen-engine`` resource and takes no more partitions; when every worker's engine has
   failed the run stops with each worker's error (:class:`daskgen.client.engines.EngineWatch`), and
   when no worker is left: at once on a fixed-size cluster the run started whose workers have all closed,
   else after ``daskgen.engine-start-timeout`` without any.
   A partition that failed because its worker's engine could not be restarted (e.g. its server
   stopped answering: :class:`~daskgen.errors.EngineUnavailable`, also raised in ``isolate`` mode
   instead of failing a row) is not held against its prompts: it is requeued as it was, for a
   worker whose engine runs.
5. **Requeue of aborted rows.**  Rows that came back ``abort`` while the run is not stopping
   (their engine was restarted under them, or their worker was drained before leaving) are
   requeued at once, restricted to those rows (:func:`~daskgen.client.outcomes.only_rows`); the stored tokens of their
   aborted samples are kept and continued.  A row aborted more than ``daskgen.abort-requeue-limit``
   times (default 10) in one run is committed ``failed`` with a message saying so
   (:meth:`Driver.requeue_aborted`); its stored tokens stay, and ``--retry-failed`` continues it.
   During a stop (target, budget, deadline, SIGTERM) aborted rows are not requeued: they stay
   pending for the next run.
6. **``--retry-failed``.**  Rows committed ``failed`` stay failed on resume unless the run is
   started again with ``--retry-failed`` (:func:`daskgen.client.plan.pending_rows`).

Done prompts a follower sends back as too stale (``follow(..., stale="regenerate")``) are set pending again
and queued like retries while the run streams, and once more before it ends (:mod:`daskgen.client.requeue`).

A partition that still fails with a storage error (:class:`~daskgen.errors.StoreError`: a disk
that is full, an object store that stays unreachable after the client's own retries and Dask's task
retries) is not held against its prompts: the run stops, keeping every partition committed before it.
Nor is a scheduler that cannot unpickle the tasks (:class:`~daskgen.errors.ClusterError`: it lacks daskgen or
runs other versions of its packages): the run stops at the first such task.  Nor is the loss of the Dask
scheduler (:class:`~daskgen.errors.SchedulerLost`,
:mod:`daskgen.client.scheduler_watch`): partitions cancelled with the connection are not failures; the
run stops as interrupted.  The tested cases: ``docs/reliability.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

from daskgen import tunables
from daskgen.client.commit import CommitBatch, Outcome
from daskgen.client.finished import FinishedPartitions
from daskgen.client.live import LiveRun
from daskgen.client.outcomes import collect, engine_unavailable, only_rows
from daskgen.client.plan import Plan, row_tasks
from daskgen.client.prefix_dispatch import TaskPool
from daskgen.client.preprocess import preprocessing
from daskgen.client.progress import Progress
from daskgen.client.requeue import LiveRequeue
from daskgen.client.scheduler_watch import SchedulerWatch
from daskgen.client.stopping import abandon, begin_stop, check_interrupt, housekeeping, stop_reason, wait_s
from daskgen.client.windows import WindowBoard
from daskgen.redaction import redact
from daskgen.store.commit_log import COMMIT_TOPIC
from daskgen.worker.partition import run_partition
from daskgen.worker.plugin import RESOURCE
from daskgen.worker.task import PartitionResult, PartitionTask

logger = logging.getLogger(__name__)


def drive(client: Any, run: LiveRun, tasks: Iterator[PartitionTask], info: Any = None, n_pending: int = 0) -> None:
    """Start the engines, then stream ``tasks`` through the cluster and commit each as it finishes (the
    counts go into ``run``)."""
    from daskgen.client.dashboard import DashboardLink
    from daskgen.client.engines import start_engines, thread_slots_note
    from daskgen.client.progress import announce_page

    link = DashboardLink(client, run)
    announce_page(link.url, enabled=run.plan.config.progress)
    link.report("starting engines", force=True)
    start_engines(client, run.plan.settings, run.stop.interrupt, run.plan.engine_args)
    record_engine(client, run.plan, thread_slots_note(client))
    run.generating()
    Driver(client, run, tasks, info, link).stream(n_pending)
    run.keep_engine_record(link.finish())


class Driver:
    """One run's streaming loop: the partitions in flight, retries, the windows and the commit batch."""

    def __init__(
        self, client: Any, run: LiveRun, tasks: Iterator[PartitionTask], info: Any = None, link: Any = None
    ) -> None:
        from daskgen.client.engines import EngineWatch

        self.client, self.run, self.tasks, self.info, self.link = client, run, tasks, info, link
        self.retry: list[PartitionTask] = []
        self.alone_in_flight = 0  # one-row tasks of partitions whose worker died too often (at most 1)
        self.futures: dict[Any, PartitionTask] = {}
        self.watch = SchedulerWatch(client)
        self.done = FinishedPartitions(
            client, on_wait=self.housekeeping, check_engines=EngineWatch(client, run.plan.config, info).check
        )
        self.board = WindowBoard(client, RESOURCE, on_change=self.done.wake)  # more admitted: submit at once
        self.batch = CommitBatch(run, on_commit=self.announce)
        self.requeue = LiveRequeue(client, run, self.busy, wake=self.done.wake)  # prompts followers send back
        self.tasks = self.requeue.track(tasks)
        lookahead = run.plan.config.max_prompts_in_memory // 2 if run.plan.prefix is not None else 0
        self.pool = TaskPool(self.tasks, lookahead)  # which task a free worker gets (prefix dispatch)
        self.bar: Progress | None = None

    def announce(self, seq: int) -> None:
        """Tell followers on this cluster (:mod:`daskgen.stream`) that commit ``seq`` landed: a Dask event.

        Sent without waiting for the scheduler (scheduled on the client's event loop): a hung scheduler must
        not hold up the run, whose scheduler watch notices it.  A hint only: the store's commit log is the truth.
        """
        msg = {"store": self.run.plan.store.url, "seq": seq}
        self.client.loop.add_callback(functools.partial(self.client.scheduler.log_event, topic=COMMIT_TOPIC, msg=msg))

    def housekeeping(self) -> bool:
        """While waiting: is the scheduler still there; lock, deadline, signals (true: stop waiting now)."""
        self.watch.check()
        self.report()
        return housekeeping(self.client, self.run, self.tasks, self.retry) or self.requeue.due()

    def busy(self) -> set[int]:
        """Partitions with a task in flight, waiting for a retry or held in the task pool (their rows are not reset
        meanwhile)."""
        return {t.start for t in (*self.futures.values(), *self.retry, *self.pool.pool)}

    def take_requeued(self, force: bool = False) -> bool:
        """Queue the rows followers sent back for generation (when due, or ``force``); true if there were any."""
        rows = self.requeue.take(force)
        if rows:
            self.retry.extend(reversed(list(row_tasks(self.run.plan, rows))))  # popped from the end: in row order
            if self.bar is not None:
                self.bar.grow(len(rows))
        return bool(rows)

    def report(self) -> None:
        """Tell the dashboard page how the run is going (at most once per ``daskgen.dashboard.interval``)."""
        if self.link is not None:  # daskgen.client.dashboard.DashboardLink
            self.link.report("stopping" if self.run.stop.stopping else "generating")

    def stream(self, n_pending: int) -> None:
        """Submit and collect until every task finished, or a stop's grace period ended."""
        refresh_every = tunables.seconds("cap-refresh-interval")
        refreshed = time.monotonic()
        self.board.refresh()
        try:
            with Progress(n_pending, enabled=self.run.plan.config.progress) as bar:
                self.bar = bar
                while self.step(bar):
                    if time.monotonic() - refreshed > refresh_every:  # workers joined/left
                        self.board.refresh()
                        refreshed = time.monotonic()
        finally:  # a storage error or a lost scheduler stops the run: what finished is still committed
            self.batch.flush(force=True)
            self.board.close()
            self.requeue.close()
            if self.pool.placed:
                plan = self.run.plan
                plan.store.update_attrs(dispatch=self.pool.record(plan.prefix, plan.prefix_order))
            self.announce_end()

    def announce_end(self) -> None:
        """Tell followers on this cluster that the run stops streaming (its lock is released soon after).

        Waits at most 2 s for the scheduler, and a failure is only logged: the hint must not hold up the run's end.
        """
        msg = {"store": self.run.plan.store.url, "seq": self.run.last_seq, "ending": True}
        try:
            self.client.sync(self.client.scheduler.log_event, topic=COMMIT_TOPIC, msg=msg, callback_timeout=2)
        except Exception as exc:  # noqa: BLE001 - a lost or hung scheduler: followers fall back to polling
            logger.debug("could not announce the run's end to followers: %r", exc)

    def step(self, bar: Progress) -> bool:
        """Submit up to the target, collect what finished, commit, check stops; false when the run is over."""
        run = self.run
        self.take_requeued()
        cap = in_flight_target(run.plan, self.board, self.info)
        self.submit_up_to(cap)
        if not self.futures:  # every row finished: a last look for rows sent back before the run ends
            return self.take_requeued(force=True)
        if run.stop.grace_over():
            abandon(self.client, self.futures)
            return False
        bar.in_flight_now(len(self.futures), cap, stopping=run.stop.stopping)
        run.note_in_flight(sum(len(t.rows) for t in self.futures.values()))
        self.collect_ready(bar)
        self.batch.flush(force=run.stop.stopping or not self.futures)
        if not run.stop.stopping and (reason := stop_reason(run, run.response_tokens)):
            begin_stop(self.client, run, reason, self.tasks, self.retry)
        check_interrupt(self.client, run, self.tasks, self.retry)
        self.report()
        return True

    def next_task(self, worker: str | None) -> PartitionTask | None:
        """The next partition to submit to ``worker``: retries first (an ``alone`` task only while no other
        is in flight), then the task pool's choice (:mod:`daskgen.client.prefix_dispatch`); none once a stop
        began."""
        if self.run.stop.stopping:
            return None
        for i in range(len(self.retry) - 1, -1, -1):
            task = self.retry[i]
            if task.alone and self.alone_in_flight:
                continue
            self.alone_in_flight += task.alone
            self.pool.started(task, worker)
            return self.retry.pop(i)
        return self.pool.take(worker)

    def submit_up_to(self, cap: int) -> None:
        """Submit partitions to the workers with free admitted slots, at most ``cap`` in flight; beyond the
        workers' slots (an adaptive cluster scaling up) to any worker.  The partitions bound for one worker
        go in one ``Client.map``: one graph update for the scheduler, not one each."""
        batches: dict[tuple[str | None, bool], list[tuple[str, PartitionTask]]] = {}
        in_flight = len(self.futures)
        while in_flight < cap:
            worker = self.board.pick()
            if worker is None and in_flight >= max(1, self.board.total()):  # one always goes: the run must
                break  # not end while no worker admits anything (every worker draining, a job starting)
            task = self.next_task(worker)
            if task is None:
                break
            key = task_key(task)
            self.board.assign(key, worker)
            batches.setdefault((worker, task.isolate), []).append((key, task))
            in_flight += 1
        retries = self.run.plan.config.max_retries
        for (worker, isolate), group in batches.items():
            keys, tasks = [k for k, _ in group], [t for _, t in group]
            for fut, task in zip(
                submit(self.client, keys, tasks, 0 if isolate else retries, worker), tasks, strict=True
            ):
                self.futures[fut] = task
                self.done.add(fut)

    def collect_ready(self, bar: Progress) -> None:
        """Wait for finished partitions and queue all that are ready for the next commit."""
        outcomes: list[Outcome] = []
        try:
            for fut, value in self.done.wait(list(self.futures), min(wait_s(self.run), self.batch.due_in())):
                task = self.futures.pop(fut, None)
                if task is None:  # delivered late after being fetched directly
                    continue
                self.board.release(fut.key)
                self.watch.check_cancelled(fut)
                self.alone_in_flight -= task.alone
                if (waiting := engine_unavailable(fut, value)) is not None:  # no prompt's fault: wait for an engine
                    fut.release()
                    logger.warning("partition %d-%d is requeued: %s", task.start, task.stop, waiting)
                    self.retry.append(task)
                    continue
                result = collect(fut, value, task)
                fut.release()
                if isinstance(result, list):  # retried enough as a whole: its rows one by one (or alone)
                    self.retry.extend(reversed(result))  # popped from the end: in row order
                    continue
                outcomes.append(self.outcome(task, result, bar))
        finally:
            self.batch.add(outcomes)

    def outcome(self, task: PartitionTask, result: PartitionResult, bar: Progress) -> Outcome:
        """What to commit of a finished partition; its aborted rows are requeued (outside a stop)."""
        given_up: dict[int, str] = {}
        if result.aborted and not self.run.stop.stopping:  # aborted by an engine restart or a drain
            again, given_up = self.requeue_aborted(result.aborted)
            if again:
                self.retry.append(only_rows(task, again))
        finished = [r for r in result.rows if r not in result.failed and r not in result.aborted]
        failed = {r: m for r, m in result.failed.items() if r not in result.aborted} | given_up
        self.run.count_result(result, len(finished) + len(failed))
        bar.update(len(finished) + len(failed), result.response_tokens, len(failed))
        return Outcome(task.start, task.stop, finished, failed, result.notes, result.response_tokens)

    def requeue_aborted(self, rows: list[int]) -> tuple[list[int], dict[int, str]]:
        """Split aborted rows into those requeued again and those aborted too often (row -> error)."""
        limit = int(tunables.get("abort-requeue-limit"))
        again, given_up = [], {}
        for r in rows:
            times = self.run.count_abort(r)
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


def record_engine(client: Any, plan: Plan, slots_note: str | None = None) -> None:
    """Store what the engine says about itself (e.g. ``retokenized`` for chat/completions servers), with
    ``slots_note`` (:func:`~daskgen.client.engines.thread_slots_note`) as its ``thread_slots`` when given."""
    from daskgen.worker.plugin import engine_description

    described = [d for d in client.run(engine_description).values() if d]
    if described:
        plan.store.update_attrs(engine=redact({**described[0], **({"thread_slots": slots_note} if slots_note else {})}))


def task_key(task: PartitionTask) -> str:
    """A fresh Dask key for one attempt at ``task`` (its mode and first row, for the dashboard and logs)."""
    mode = "alone" if task.alone else "isolated" if task.isolate else "partition"
    return f"daskgen-{mode}-{task.rows[0] if task.alone else task.start}-{time.time_ns()}"


def submit(client: Any, keys: list[str], tasks: list[PartitionTask], retries: int, worker: str | None = None) -> list:
    """Submit partitions under ``keys`` in one graph; to ``worker`` when given (loosely: elsewhere if that
    worker is gone)."""
    where = {} if worker is None else {"workers": [worker], "allow_other_workers": True}
    keyed = [dataclasses.replace(task, key=key) for key, task in zip(keys, tasks, strict=True)]
    images = preprocessing(client, keyed, retries)  # None for each partition its engine worker prepares itself
    given = [images] if any(image is not None for image in images) else []
    return client.map(
        run_partition, keyed, *given, key=keys, pure=False, retries=retries, resources={RESOURCE: 1}, **where
    )
