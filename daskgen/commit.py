"""Client-side commits: ``error``, ``committed_at``, then ``status`` (the checkpoint) of finished rows.

The client is the only writer of ``status``; it writes a row's status only after the row's data
landed (the partition task returned), so a row marked done always has its data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from daskgen import store

if TYPE_CHECKING:
    from daskgen.runner import Plan


def commit_overlong(plan: Plan) -> None:
    pending = [i for i in plan.prompts.overlong if plan.status[i] == store.PENDING]
    for start in sorted({i - i % plan.layout.partition_size for i in pending}):
        stop = min(start + plan.layout.partition_size, plan.layout.n_prompts)
        rows = [i for i in pending if start <= i < stop]
        commit_rows(plan, start, stop, {i: plan.prompts.overlong[i] for i in rows})


@dataclass
class Outcome:
    """Rows of one finished partition to commit."""

    start: int
    stop: int
    done: list[int]
    failed: dict[int, str]
    notes: dict[int, str]


def commit_outcomes(plan: Plan, outcomes: list[Outcome]) -> None:
    """Commit finished partitions with one write of ``status`` (and ``error``/``committed_at``) per
    coarse chunk they fall in, instead of one per partition.

    Rows in between keep their in-memory status (the client is the only writer of ``status``).
    """
    groups: dict[int, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.start // store.COARSE_CHUNK, []).append(o)
    for group in groups.values():
        start, stop = min(o.start for o in group), max(o.stop for o in group)
        failed = {r: m for o in group for r, m in o.failed.items()}
        notes = {r: m for o in group for r, m in o.notes.items()}
        commit_rows(plan, start, stop, failed, done=[r for o in group for r in o.done], notes=notes)


def commit_rows(plan: Plan, start: int, stop: int, failed: dict[int, str], done: Sequence[int] = (),
            notes: dict[int, str] | None = None) -> None:
    """Write error then status for rows of one partition; update the in-memory mask.

    ``notes`` (e.g. verifier exceptions) go into ``error`` of rows that are nevertheless done.
    """
    new = plan.status[start:stop].copy()
    for i in done:
        new[i - start] = store.DONE
    for i in failed:
        new[i - start] = store.FAILED
    errors = None
    if failed or notes or np.any(plan.status[start:stop] == store.FAILED):
        errors = [str(e) for e in store.read_region(plan.config.location(), start, stop, ("error",))["error"]]
        for i in done:
            errors[i - start] = (notes or {}).get(i, "")
        for i, msg in failed.items():
            errors[i - start] = msg
    plan.committed_at[[*done, *failed]] = time.time()
    _maybe_pause_before_commit()
    store.commit(plan.config.location(), start, new, errors, plan.committed_at[start:stop])
    plan.status[start:stop] = new


def _maybe_pause_before_commit() -> None:
    """Fault injection for tests only: widen the window between a partition's data write and its commit."""
    delay = float(os.environ.get("DASKGEN_TEST_COMMIT_DELAY_S", "0") or 0)
    if delay:
        time.sleep(delay)
