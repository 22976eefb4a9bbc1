"""Stopping a run from outside: SIGTERM / SIGINT, and the end of the batch allocation.

The first signal asks the run to stop gracefully (nothing more is submitted, every in-flight
request is aborted keeping its tokens, finished partitions and partial responses are committed
within the grace period, the lock is released) and the run exits with :data:`EXIT_INTERRUPTED`.
A second signal stops at once (what was committed stays committed).  Once a run of the ``daskgen run``
command is over (everything committed, its summary taken), a SIGTERM no longer stops the process: it
only shuts down, and exits with the run's status.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

from daskgen.exit_codes import ExitCode

logger = logging.getLogger(__name__)

#: Exit status of a run stopped from outside before it finished (resumable: rerun the same command).
EXIT_INTERRUPTED = ExitCode.INTERRUPTED
#: Signals that stop a run gracefully.
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Part of the grace period kept for closing the cluster and releasing the lock after collecting.
CLOSE_RESERVE_FRACTION = 0.25


class Interrupt:
    """Context manager that turns SIGTERM/SIGINT into a graceful stop request.

    Parameters
    ----------
    grace_s:
        Seconds from the request until the process should have exited (a run sets it once its settings are
        resolved).
    install:
        Install signal handlers (only possible, and only done, in the main thread).
    ignore_sigterm_after:
        When the ``with`` block ends without an exception, leave SIGTERM ignored instead of restoring its
        previous handler (SIGINT's is restored): for a process that only shuts down after the run (the
        ``daskgen run`` command), which then ends with the run's status whenever a SIGTERM comes.
    """

    def __init__(self, grace_s: float = 0.0, install: bool = True, ignore_sigterm_after: bool = False) -> None:
        self.grace_s = float(grace_s)
        self.reason: str | None = None
        self.requested_at: float | None = None
        self._install = install and threading.current_thread() is threading.main_thread()
        self._ignore_sigterm_after = ignore_sigterm_after
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        if self._install:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Restore the handlers from before; after a run that returned, SIGTERM ignored when asked (no gap between:
        a SIGTERM reaching the process from here on finds one or the other)."""
        ignore = self._ignore_sigterm_after and kind is None
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore and sig == signal.SIGTERM else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.reason is not None:
            print(
                f"daskgen: {name} again: stopping now (committed work is kept; rerun the same command to resume)",
                file=sys.stderr,
                flush=True,
            )
            raise KeyboardInterrupt(f"{name} received twice")
        self.request(f"{name} received", announce=False)
        print(
            f"daskgen: {name} received: stopping — aborting in-flight requests, committing finished work and "
            f"saving partial responses (up to {self.grace_s:.0f} s; send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def request(self, reason: str, announce: bool = True) -> None:
        """Ask the run to stop gracefully (the first request wins); ``announce``: log the reason (a signal's
        handler prints its own line instead)."""
        if self.reason is None:
            self.reason, self.requested_at = reason, time.monotonic()
            if announce:
                logger.warning("stopping: %s", reason)

    @property
    def requested(self) -> bool:
        """True once a stop was requested."""
        return self.reason is not None

    def collect_until(self) -> float | None:
        """``time.monotonic()`` by which in-flight partitions must have been collected."""
        if self.requested_at is None:
            return None
        return self.requested_at + self.grace_s * (1 - CLOSE_RESERVE_FRACTION)


def allocation_end() -> float | None:
    """Unix time at which the batch allocation running this process ends, when known.

    SLURM: ``SLURM_JOB_END_TIME`` (set by newer SLURM releases), else ``squeue``'s end time of
    ``SLURM_JOB_ID``.  ``None`` outside an allocation or when the end is unknown (no time limit).
    """
    end = os.environ.get("SLURM_JOB_END_TIME")
    if end and end.strip().isdigit():
        return float(end)
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_slurm_time(out.stdout.strip())


def parse_slurm_time(text: str) -> float | None:
    """``2026-11-22T20:00:00`` (local time) as a Unix time; ``None`` for N/A, Unknown or garbage."""
    import datetime as dt

    try:
        return dt.datetime.fromisoformat(text).astimezone().timestamp()
    except ValueError:
        return None
