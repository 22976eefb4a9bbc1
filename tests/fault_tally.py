"""The fault table of docs/reliability.md, from the fault tests themselves.

A fault test calls :func:`record` after its last assertion passed (the run completed, the store equals a
fault-free run's, ``daskgen verify`` found it sound): one JSON line per fault tried, appended to the file
named by ``DASKGEN_FAULT_TALLY`` (nothing is written when it is unset).  ``rows lost`` is 0 by
construction of that order: a test that lost a row fails before it records.  ``regenerated`` is what the
test knows was generated again: the rows pending when the fault hit that a previous attempt had worked on;
a test that can only bound it (every row not committed when the fault hit) says ``exact=False``, and the
table shows "≤".

    DASKGEN_FAULT_TALLY=/tmp/tally.jsonl python -m pytest tests/test_torn_writes.py ...
    python -m tests.fault_tally /tmp/tally.jsonl      # prints the Markdown table
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict


def record(fault: str, *, rows: int, regenerated: int, runs: int = 1, lost: int = 0, exact: bool = True) -> None:
    """Append one passed fault test's figures to ``$DASKGEN_FAULT_TALLY`` (if set)."""
    path = os.environ.get("DASKGEN_FAULT_TALLY")
    if not path:
        return
    line = {"fault": fault, "runs_completed": runs, "rows": rows, "rows_lost": lost, "regenerated": int(regenerated)}
    line["exact"] = exact
    with open(path, "a") as fh:  # one O_APPEND write per line
        fh.write(json.dumps(line) + "\n")


def table(path: str) -> str:
    """The Markdown table of a tally file: one line per fault, summed over repeated runs of its test."""
    sums: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            for key in ("runs_completed", "rows", "rows_lost", "regenerated"):
                sums[row["fault"]][key] += row[key]
            sums[row["fault"]]["tried"] += 1
            sums[row["fault"]]["bounded"] += not row.get("exact", True)
    out = ["| fault | tried | runs completed | rows | rows lost | rows regenerated |", "|---|---|---|---|---|---|"]
    for fault, s in sums.items():
        regenerated = f"≤ {s['regenerated']}" if s["bounded"] else str(s["regenerated"])
        out.append(
            f"| {fault} | {s['tried']} | {s['runs_completed']} | {s['rows']} | {s['rows_lost']} | {regenerated} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1]))
