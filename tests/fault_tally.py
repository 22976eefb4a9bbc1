"""The fault table of docs/reliability.md, from the fault tests themselves.

A fault test calls :func:`record` after its last assertion passed (the run completed, the store equals a
fault-free run's, ``daskgen verify`` found it sound): one JSON line per fault tried, appended to the file
named by ``DASKGEN_FAULT_TALLY`` (nothing is written when it is unset).  ``rows lost`` is 0 by
construction of that order: a test that lost a row fails before it records.

The other figures are counted, never given: :func:`count` reads them from the request ids that reached
the engine (the log of the recording engine, ``daskgen.testing.engines.RecordingEngine``, or the probe
engine's ``arrive`` events), split at the fault into the requests sent before it and those sent after:

* **kept** -- rows the engine had worked on before the fault none of whose samples reached it again;
* **regenerated** -- rows with a sample that reached the engine more than once (generated again from its
  prompt);
* **continued** -- rows with a sample that reached the engine again to continue the tokens an interrupted
  attempt stored (the rerun sends the prompt and that prefix), and no sample generated again.

A fault that acts on the whole run instead of at one moment (a share of faulty object-store requests) has
no "after": every request is "before".

    DASKGEN_FAULT_TALLY=/tmp/tally.jsonl python -m pytest tests/test_torn_writes.py ...
    python -m tests.fault_tally /tmp/tally.jsonl      # prints the Markdown table
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from daskgen.testing.probes import read_events, row_of

FIGURES = ("runs_completed", "rows", "rows_lost", "kept", "regenerated", "continued")


@dataclass(frozen=True)
class Tally:
    """Rows kept, regenerated and continued after a fault (see the module docstring)."""

    kept: int
    regenerated: int
    continued: int = 0


def recorded(run: list, log: Path) -> list:
    """``run`` (``daskgen run`` options naming ``--engine simulated``) with that engine inside the recording
    engine, which appends the id of each request it is sent to ``log``."""
    at = run.index("simulated")
    recording = ["daskgen.testing.engines:RecordingEngine", "--engine-arg", "inner=simulated"]
    return [*run[:at], *recording, "--engine-arg", f"log_path={log}", *run[at + 1 :]]


def logged_requests(path: Path) -> list[str]:
    """The request ids a recording engine's log at ``path`` holds, in the order they reached the engine."""
    if not path.exists():
        return []
    return [line.split()[0] for line in path.read_text().splitlines() if line.strip()]


def probed_requests(path: Path) -> list[str]:
    """The request ids that arrived at a probe engine whose events are at ``path``, in arrival order."""
    return [event.request_id for event in read_events(path) if event.kind == "arrive"]


def count(before: Iterable[str], after: Iterable[str] = (), continued: Iterable[str] = ()) -> Tally:
    """Count the rows kept, regenerated and continued from the request ids sent ``before`` and ``after`` the
    fault; ``continued`` names the samples (request ids) whose stored tokens the rerun continued."""
    before = list(before)
    calls = Counter(before) + Counter(after)
    resumed = {request for request in continued if calls[request] > 1}
    again = {request for request, n in calls.items() if n > 1 + (request in resumed)}
    regenerated = {row_of(request) for request in again}
    continued_rows = {row_of(request) for request in resumed} - regenerated
    kept = {row_of(request) for request in before} - regenerated - continued_rows
    return Tally(kept=len(kept), regenerated=len(regenerated), continued=len(continued_rows))


def record(fault: str, *, rows: int, tally: Tally, runs: int = 1, lost: int = 0) -> None:
    """Append one passed fault test's figures to ``$DASKGEN_FAULT_TALLY`` (if set)."""
    path = os.environ.get("DASKGEN_FAULT_TALLY")
    if not path:
        return
    line = {"fault": fault, "runs_completed": runs, "rows": rows, "rows_lost": lost, **asdict(tally)}
    with open(path, "a") as fh:  # one O_APPEND write per line
        fh.write(json.dumps(line) + "\n")


def table(path: str) -> str:
    """The Markdown table of a tally file: one line per fault, summed over repeated runs of its test."""
    sums: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            for key in FIGURES:
                sums[row["fault"]][key] += row[key]
            sums[row["fault"]]["tried"] += 1
    out = [
        "| fault | tried | runs completed | rows | rows lost | rows kept | rows regenerated | rows continued |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fault, s in sums.items():
        out.append(f"| {fault} | {s['tried']} | " + " | ".join(str(s[key]) for key in FIGURES) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1]))
