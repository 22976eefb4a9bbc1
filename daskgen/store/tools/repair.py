"""``daskgen verify --repair``: reset exactly the partitions ``verify`` found wrong, so a rerun regenerates them.

Under the store's lock (no run may write meanwhile):

* a data problem (a chunk that fails its checksum or does not decode, a missing chunk, a finished row
  that breaks an invariant) resets its whole partition: every data array's region is rewritten with
  fill values and the partition's rows become pending (``status`` 0, empty ``error``, no commit time);
* an unreadable chunk of the commit record (``status``, ``error``, ``committed_at``, ``commit_seq``) is rewritten whole:
  its rows become pending (their data, if sound, is kept, and the next run keeps their finished
  samples instead of regenerating them);
* an unreadable coordinate chunk is rewritten: ``prompt_index`` from the row numbers, ``prompt_id`` from
  the run's input file when it still holds the store's input.

What was done is appended to the store's run history (a record with ``"kind": "repair"``).  A packed
store is refused: its partitions share shard files, so ``daskgen unpack`` it first.
"""

from __future__ import annotations

import numpy as np

from daskgen.errors import StoreError
from daskgen.store.generation_store import COMMIT_ARRAYS, GenerationStore
from daskgen.store.layout import PENDING, empty_region
from daskgen.store.records.lock import StoreLock
from daskgen.store.tools.verify import VerifyReport

#: The coordinates, rewritten from what they must hold rather than reset.
COORDINATE_ARRAYS = ("prompt_index", "prompt_id")


def repair(store: GenerationStore, report: VerifyReport) -> dict[str, list[int]]:
    """Reset what ``report`` found; returns the partitions and coarse chunks reset (their start rows)."""
    if store.attrs.packed:
        raise StoreError(
            f"cannot repair {store.url!r} while it is packed (its partitions share shard files): run "
            f"`daskgen unpack {store.url}`, then `daskgen verify --repair {store.url}` again."
        )
    size, coarse = store.layout.partition_size, store.commit_chunk_rows
    commit_chunks = sorted({p.start for p in report.problems if p.array in COMMIT_ARRAYS})
    coordinates = sorted({(p.array, p.start) for p in report.problems if p.array in COORDINATE_ARRAYS})
    data = [p for p in report.problems if p.array not in (*COMMIT_ARRAYS, *COORDINATE_ARRAYS)]
    data_rows = {r for p in data for r in range(p.start, p.stop)}
    partitions = store.layout.partitions_of(data_rows)
    with StoreLock(store.location):
        store.refresh_attrs()  # under the lock: the run history is appended to what is there now
        for start in commit_chunks:  # first: a partition's commit below then reads a sound chunk
            _reset_commit_chunk(store, start, min(start + coarse, store.layout.n_prompts))
        for name, start in coordinates:
            _rewrite_coordinates(store, name, start, min(start + coarse, store.layout.n_prompts))
        for start in partitions:
            _reset_partition(store, start, min(start + size, store.layout.n_prompts))
        done = {"partitions": partitions, "commit_chunks": commit_chunks, "rows": report.rows()}
        store.append_run({"kind": "repair", **done, "problems": [p.detail for p in report.problems[:20]]})
    return done


def _reset_commit_chunk(store: GenerationStore, start: int, stop: int) -> None:
    """Rewrite a whole coarse chunk of the commit record (not read first): its rows become pending."""
    n = stop - start
    store.commit(start, np.full(n, PENDING, dtype="int8"), [""] * n, np.full(n, np.nan), np.zeros(n, dtype="int64"))


def _reset_partition(store: GenerationStore, start: int, stop: int) -> None:
    """Fill values into every data array of the partition; its rows become pending (other rows untouched)."""
    region = empty_region(store.layout, stop - start)
    store.write_region(start, region)
    n = stop - start
    store.commit(start, np.full(n, PENDING, dtype="int8"), [""] * n, np.full(n, np.nan))


def _rewrite_coordinates(store: GenerationStore, name: str, start: int, stop: int) -> None:
    """Rewrite a coordinate chunk from what it must hold."""
    if name == "prompt_index":
        values: np.ndarray = np.arange(start, stop, dtype="int64")
    else:
        values = np.array(_input_ids(store, start, stop), dtype=object).astype(str)
    with store.write_errors(f"rewriting {name} rows {start}..{stop - 1}"):
        store.array(name, writable=True)[start:stop] = values


def _input_ids(store: GenerationStore, start: int, stop: int) -> list[str]:
    """The input's ``id`` values of rows ``[start, stop)``, read from the run's input file."""
    from pathlib import Path

    from daskgen.input.rows import holds_input, iter_selected_rows

    source = Path(str(store.attrs.config.get("prompts") or ""))
    if not holds_input(source, store.attrs.input.get("fingerprint")):
        raise StoreError(
            f"cannot rewrite prompt_id rows {start}..{stop - 1} of {store.url!r}: the run's input file "
            f"({store.attrs.config.get('prompts')!r}) is gone or changed. Restore it, then repair again."
        )
    return [str((row or {}).get("id") or "") for _, row in iter_selected_rows(source, iter(range(start, stop)))]
