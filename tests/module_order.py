"""Longest modules first: the order the main lane hands whole modules to its pytest-xdist processes.

Under ``--dist loadscope --no-loadscope-reorder`` each process takes the next module in collection order when it
is free, so starting with the modules that took longest (longest-processing-time-first) keeps a long module from
starting last and ending the lane on one process while the others idle.  The seconds per module come from a
measured run, kept in ``tests/module_seconds.json``; ``pytest --store-module-seconds`` writes the modules of
that run back into it (setup, call and teardown of each test, summed per module).  A module not in the file
counts as 0 s and keeps its collection order after the measured ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("module_seconds.json")


def module_of(nodeid: str) -> str:
    """``tests/test_x.py`` of ``tests/test_x.py::TestY::test_z[p]``."""
    return nodeid.split("::", 1)[0]


def read_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The measured seconds per module (empty when the file is missing)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def longest_first(nodeids: Iterable[str], seconds: dict[str, float]) -> list[int]:
    """Indices of ``nodeids`` with the modules in descending measured seconds; ties and unmeasured modules keep
    their collection order, and the tests of a module keep theirs."""
    ids = list(nodeids)
    first_seen = {}
    for i, nodeid in enumerate(ids):
        first_seen.setdefault(module_of(nodeid), i)
    return sorted(
        range(len(ids)), key=lambda i: (-seconds.get(module_of(ids[i]), 0.0), first_seen[module_of(ids[i])], i)
    )


def named_last(order: list[int], last: list[bool], groups: list[str]) -> list[int]:
    """``order`` with the items marked ``last`` moved behind the other items of their group (e.g. a test class); the
    groups and the other items keep their places."""
    position = {i: place for place, i in enumerate(order)}
    ends = {groups[i]: place for place, i in enumerate(order)}
    return sorted(order, key=lambda i: (ends[groups[i]] if last[i] else position[i], last[i]))


def store_seconds(durations: dict[str, float], path: Path = SECONDS_FILE) -> None:
    """Write the per-module ``durations`` of a pytest run into ``path``, keeping the modules it did not run."""
    merged = {**read_seconds(path), **{module: round(s, 1) for module, s in durations.items()}}
    path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
