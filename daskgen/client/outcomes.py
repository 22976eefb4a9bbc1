"""What a partition task's future gave back, turned into what the run does next: commit its result, run other
tasks in its place (row isolation, one-row ``alone`` tasks), or stop the run (the storage or the cluster is at
fault, not the prompts).  The policy itself is described in :mod:`daskgen.client.driver`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from distributed.scheduler import KilledWorker

from daskgen.errors import ClusterError, EngineUnavailable, StoreError
from daskgen.worker.task import PartitionResult, PartitionTask

logger = logging.getLogger(__name__)

#: The start of distributed's message when its scheduler cannot unpickle a submitted graph (``update_graph``): the
#: scheduler lacks daskgen, or runs other versions of it or of its dependencies.
UNPICKLE_FAILURE = "Error during deserialization of the task graph"


def only_rows(task: PartitionTask, rows: list[int]) -> PartitionTask:
    """The same partition restricted to ``rows`` (the other rows' stored data is kept)."""
    keep = [i for i, r in enumerate(task.rows) if r in set(rows)]
    meta = None if task.rows_meta is None else [task.rows_meta[i] for i in keep]
    prompts = None if task.prompts is None else [task.prompts[i] for i in keep]
    inputs = None if task.inputs is None else [task.inputs[i] for i in keep]
    return dataclasses.replace(task, rows=[task.rows[i] for i in keep], prompts=prompts, rows_meta=meta, inputs=inputs)


def engine_unavailable(fut: Any, value: Any) -> EngineUnavailable | None:
    """The :class:`~daskgen.errors.EngineUnavailable` a failed partition task raised, else ``None``."""
    exc = value[1] if fut.status == "error" and isinstance(value, tuple) else value
    return exc if isinstance(exc, EngineUnavailable) else None


def collect(fut: Any, value: Any, task: PartitionTask) -> PartitionResult | list[PartitionTask]:
    """The partition's result, or the tasks to run in its place; all its rows failed if nothing is left to try.

    ``value`` is what ``as_completed(with_results=True, raise_errors=False)`` gave: the result, the
    ``(type, exception, traceback)`` of a failed task, or the exception of a cancelled one.  A task that
    failed after its retries is run again row by row in one ``isolate`` task; one whose worker died too
    often (``KilledWorker``), as one-row ``alone`` tasks (:func:`split_alone`).
    """
    try:
        if fut.status == "error" and isinstance(value, tuple):
            raise value[1]
        if isinstance(value, Exception):
            raise value
        if not isinstance(value, PartitionResult):
            raise RuntimeError(f"task ended {fut.status!r}: {value!r}")
        return value
    except StoreError:
        raise  # the storage is the problem, not the prompts: stop the run, keep what is committed
    except RuntimeError as exc:
        if UNPICKLE_FAILURE not in str(exc):
            return failed_after_retries(task, exc)
        raise ClusterError(
            "the Dask scheduler could not unpickle daskgen's partition tasks (distributed: "
            f"{' '.join(str(exc).split())}): it lacks daskgen, or runs other versions of daskgen or of its "
            "dependencies than this client. Run the scheduler in the client's environment (the same Python packages), "
            "then rerun the same command to resume; no prompt was marked failed."
        ) from exc
    except KilledWorker as exc:
        if task.alone:
            return failed_alone(task, exc)
        logger.error(
            "the worker died %d times while generating rows %d..%d: they are run again one at a time",
            exc.allowed_failures + 1,
            task.rows[0],
            task.rows[-1],
        )
        return split_alone(task)
    except Exception as exc:
        return failed_after_retries(task, exc)


def failed_after_retries(task: PartitionTask, exc: Exception) -> PartitionResult | list[PartitionTask]:
    """A task that failed after its retries: run again row by row in one ``isolate`` task, or, isolated already
    (or of one row), every row failed with the error."""
    mode = " in isolated mode" if task.isolate else " after retries"
    logger.error("partition %d-%d failed%s: %s", task.start, task.stop, mode, exc)
    if not task.isolate and len(task.rows) > 1:
        return [dataclasses.replace(task, isolate=True)]
    msg = f"partition failed after retries: {type(exc).__name__}: {exc}"
    return PartitionResult(task.start, task.stop, list(task.rows), failed={r: msg for r in task.rows})


def split_alone(task: PartitionTask) -> list[PartitionTask]:
    """One ``alone`` task per row of ``task`` (whose worker died too often), in row order."""
    return [dataclasses.replace(only_rows(task, [r]), isolate=True, alone=True) for r in task.rows]


def failed_alone(task: PartitionTask, exc: KilledWorker) -> PartitionResult:
    """A one-row ``alone`` task whose worker died too often again: its row is committed failed, saying so."""
    (row,) = task.rows
    deaths = exc.allowed_failures + 1
    logger.error("row %d failed: the worker died %d times while generating it alone", row, deaths)
    msg = (
        f"the worker process died while generating this row ({deaths} times, with no other such row in flight; "
        f"distributed.scheduler.allowed-failures is {exc.allowed_failures}): it appears to kill the process the engine "
        "runs in (a crash or an out-of-memory kill: see the worker logs); rerun with --retry-failed to try it again"
    )
    return PartitionResult(task.start, task.stop, [row], failed={row: msg})
