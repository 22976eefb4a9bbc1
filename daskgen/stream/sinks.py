"""``daskgen follow``: stream a store's finished samples to stdout (JSONL) or to one Parquet file per batch.

Each batch is acknowledged only after its output is durably written: JSONL lines are flushed to stdout
(and synced when stdout is a file); a Parquet file is written beside its final name, synced and renamed
into place.  A follower killed before an ack gets the batch again when it restarts: a Parquet batch is
then rewritten under the same name (``batch-<number>.parquet``), so a Parquet folder holds every
finished sample exactly once; on stdout the lines of that one batch appear twice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from daskgen.errors import FollowError
from daskgen.formats.records import json_line
from daskgen.store.location import StoreRef
from daskgen.stream.batches import Batch, Follower
from daskgen.stream.options import FollowOptions, SinkOptions
from daskgen.stream.order import WindowStats

SINKS = ("jsonl", "parquet-dir")


@dataclass
class FollowSummary:
    """What ``daskgen follow`` delivered."""

    batches: int = 0
    prompts: int = 0
    samples: int = 0
    failed: int = 0
    pending: int = 0
    window: WindowStats | None = None
    stale: int = 0  # samples delivered flagged too stale (--max-staleness)
    requeued: int = 0  # prompts sent back for generation (--stale regenerate)

    def line(self, cursor: str) -> str:
        """The closing line (stderr)."""
        text = (
            f"daskgen follow: {self.samples} samples of {self.prompts} prompts in {self.batches} batches, "
            f"{self.failed} failed prompts (cursor {cursor!r})"
        )
        if self.window is not None:
            w = self.window
            text += (
                f"; window of {w.window}: prompts held back by its head {w.total_head_wait:.1f} s in total "
                f"(longest before one batch {w.max_head_wait:.1f} s)"
            )
        if self.stale or self.requeued:
            text += f"; {self.stale} stale samples flagged, {self.requeued} prompts requeued for generation"
        return text + (f"; {self.pending} prompts still pending" if self.pending else "")


def follow_to(
    store: StoreRef, sink: SinkOptions, options: FollowOptions, *, stdout: IO[str] = sys.stdout
) -> FollowSummary:
    """Write every batch of ``store`` to ``sink.sink`` (``jsonl`` on ``stdout``, or ``parquet-dir`` in ``sink.out``).

    ``options`` say how the store is followed (``cursor``, ``batch_prompts``, ``wait``, ``timeout``, ...);
    batches are acknowledged here, after their output is durable.
    """
    out = sink.out
    if sink.sink not in SINKS:
        raise FollowError(f"unknown --format {sink.sink!r}; choose one of {', '.join(SINKS)}.")
    if sink.sink == "parquet-dir":
        if out is None:
            raise FollowError("--format parquet-dir writes one file per batch into --out DIR: pass --out.")
        out.mkdir(parents=True, exist_ok=True)
    summary = FollowSummary()
    fmt = "rows" if sink.sink == "jsonl" else "arrow"  # the records of the JSONL export, the Parquet export's table
    with Follower(store, options, format=fmt, auto_ack=False) as follower:
        for batch in follower:
            if sink.sink == "jsonl":
                _write_jsonl(batch.data, stdout)
            else:
                _write_parquet(batch.data, out / f"{batch.name}.parquet")  # type: ignore[operator]
            _report_failed(batch)
            batch.ack()
            summary.batches, summary.prompts = summary.batches + 1, summary.prompts + len(batch)
            summary.samples, summary.failed = summary.samples + len(batch.data), summary.failed + batch.n_failed
            summary.stale, summary.requeued = summary.stale + batch.stale, summary.requeued + len(batch.requeued)
        summary.pending, summary.window = follower.pending_at_end, follower.stats
    return summary


def _write_jsonl(records: list[dict[str, Any]], stdout: IO[str]) -> None:
    for record in records:
        stdout.write(json_line(record) + "\n")
    stdout.flush()
    try:
        if os.path.isfile(f"/proc/self/fd/{stdout.fileno()}"):
            os.fsync(stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a pipe, a test buffer)
        pass


def _write_parquet(table: Any, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _report_failed(batch: Batch) -> None:
    for row, error in batch.failed.items():
        print(f"daskgen follow: prompt {row} failed: {error}", file=sys.stderr, flush=True)
