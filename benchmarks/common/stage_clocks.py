"""CPU time per stage of a follower's batch: the stages' functions wrapped where they are looked up."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

#: Stages of a follower's batch, as (module, attribute, label): each is timed where it is called from, in CPU
#: time of its own thread, but reading the arrays: of the whole process (Zarr decodes chunks in its threads).
STAGES = (
    ("daskgen.stream.batches", "read_rows", "read the arrays"),
    ("daskgen.stream.batches", "batch_data", "assemble the format"),
    ("daskgen.store.records.cursors", "Cursor.save", "acknowledge: write and flush the cursor"),
    ("daskgen.stream.batches", "read_snapshot", "read the commit log"),
    ("daskgen.formats.read", "PromptIds.__call__", "prompt ids"),
)


@contextlib.contextmanager
def stage_clocks() -> Iterator[dict[str, float]]:
    """CPU seconds of this process spent in each of :data:`STAGES` (those the daskgen imported has) while the
    block runs: the functions are wrapped where they are looked up, and put back afterwards."""
    import importlib

    spent: dict[str, float] = {}
    undo = []
    for module_name, attribute, label in STAGES:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name, None)
        if original is None:
            continue

        clock = time.process_time if name == "read_rows" else time.thread_time

        def timed(*args: Any, _f: Any = original, _label: str = label, _clock: Any = clock, **kwargs: Any) -> Any:
            t0 = _clock()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + _clock() - t0

        setattr(owner, name, timed)
        undo.append((owner, name, original))
    try:
        yield spent
    finally:
        for owner, name, original in undo:
            setattr(owner, name, original)
