"""Helpers for tests that watch a run from outside: the probe engine's events, a process's output lines.

The probe engine (:mod:`daskgen.testing.probes`, a labelled test double) records every request that
reaches the engine and can hold chosen ones at a gate; these helpers start ``daskgen run`` with it
and wait for events instead of guessing how long something takes.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from daskgen.testing.probes import read_events, row_of

PROBE = [
    "--engine",
    "daskgen.testing.probes:ProbeEngine",
    "--engine-arg",
    "inner=simulated",
    "--model",
    "sim",
    "--max-new-tokens",
    "16",
    "--max-prompt-tokens",
    "128",
]


def probe_args(tmp_path: Path, store_path, *extra, events: str = "events.log", step: float = 0.0) -> list:
    """``daskgen run`` arguments for the simulated engine behind the probe (events in ``tmp_path/events``)."""
    return [
        *PROBE,
        "--engine-arg",
        f"events_path={tmp_path / events}",
        "--engine-arg",
        f"time_scale={step}",
        "--store",
        store_path,
        *extra,
    ]


def gate_args(gate: Path, rows: list[int]) -> list[str]:
    """Arguments that hold every request of ``rows`` at the engine until the file ``gate`` exists."""
    return ["--engine-arg", f"gate_path={gate}", "--engine-arg", f"gate_rows={rows}"]


def wait_for_arrival(events: Path, proc: subprocess.Popen, row: int, timeout: float = 120.0) -> None:
    """Wait until a request of prompt ``row`` reached the engine (the run must still be going)."""
    deadline = time.monotonic() + timeout
    while not any(e.kind == "arrive" and row_of(e.request_id) == row for e in read_events(events)):
        assert proc.poll() is None, f"the run ended first: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"no request of row {row} reached the engine in {timeout} s"
        time.sleep(0.05)


class OutputLines:
    """Collects a process's output lines in a thread, so a test can wait for one without blocking."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        """Wait until a line containing ``text`` was printed."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, f"{text!r} not printed in {timeout} s:\n{self.text()}"
            assert self._thread.is_alive() or any(text in line for line in self.lines), self.text()
            time.sleep(0.05)

    def text(self) -> str:
        """Everything read so far (all of it once the process ended and :meth:`join` returned)."""
        return "".join(self.lines)

    def join(self, timeout: float = 60.0) -> str:
        """Wait for the end of the output; returns all of it."""
        self._thread.join(timeout)
        return self.text()
