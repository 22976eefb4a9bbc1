"""``daskgen verify``: read every chunk of a store and check what a finished row promises.

Every chunk of every array is read (in parallel: tasks on a Dask cluster when given, else local
threads), so a chunk whose checksum fails or that does not decode is found; the rows of finished
(``done``) partitions are checked against :mod:`daskgen.store.tools.invariants`; the data chunks that each
finished partition must have written, derived per array from its rows and the run's settings (a row's own
adapter, format and kept input columns from the run's input file: :mod:`daskgen.store.tools.expected_chunks`), are
checked to exist (a chunk that is not there reads back as fill values without an error): a chunk file, or in a
packed store an entry in its shard's index (:mod:`daskgen.store.chunks.shard_index`).  The result names the affected
rows (index and ``id``), arrays and chunk keys, and what could not be checked; :func:`daskgen.store.tools.repair.repair`
resets exactly the affected partitions to pending.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskgen.store.chunks.shard_index import inner_present, read_index, shard_key, shard_of, sharding
from daskgen.store.fingerprint import digest_number
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE
from daskgen.store.location import StoreRef
from daskgen.store.policy import read_versions
from daskgen.store.tools.expected_chunks import ExpectedChunk, PartitionRows, expected_chunks, known_texts
from daskgen.store.tools.image_checks import ImageRules, stored_image_problems
from daskgen.store.tools.invariants import RowRules, broken_rows


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the array and chunk it is in, the rows ``[start, stop)`` it affects, and what it is."""

    kind: str  # "checksum", "decode", "missing chunk", "invariant" or "image"
    array: str
    chunk: str
    start: int
    stop: int
    detail: str


@dataclass
class VerifyReport:
    """What ``verify`` found in a store."""

    url: str
    checksummed: bool
    chunks: int = 0
    done_rows: int = 0
    problems: list[Problem] = field(default_factory=list)
    ids: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what could not be checked and why; images kept as references

    @property
    def sound(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems

    def rows(self) -> list[int]:
        """Every affected row, sorted."""
        return sorted({r for p in self.problems for r in range(p.start, p.stop)})

    def lines(self, limit: int = 50) -> list[str]:
        """The report as text: one line per problem (at most ``limit``), then a summary line."""
        out = [self._line(p) for p in self.problems[:limit]]
        if len(self.problems) > limit:
            out.append(f"... and {len(self.problems) - limit} more problem(s)")
        out += [f"note: {note}" for note in self.notes]
        checks = f"{self.chunks} chunks read, {self.done_rows} done rows checked"
        checks += "" if self.checksummed else " (this store has no chunk checksums: decoding and invariants only)"
        if self.sound:
            return [*out, f"{self.url}: sound ({checks})"]
        return [*out, f"{self.url}: {len(self.rows())} row(s) affected by {len(self.problems)} problem(s) ({checks})"]

    def _line(self, p: Problem) -> str:
        rows = f"row {p.start}" if p.stop - p.start == 1 else f"rows {p.start}..{p.stop - 1}"
        ids = [self.ids[r] for r in range(p.start, min(p.stop, p.start + 3)) if self.ids.get(r)]
        named = f" (id {', '.join(repr(i) for i in ids)}{', ...' if p.stop - p.start > 3 else ''})" if ids else ""
        return f"{p.kind}: {p.array} chunk {p.chunk}, {rows}{named}: {p.detail}"


def row_rules(store: GenerationStore) -> RowRules:
    """The rules a finished row of ``store`` must follow, from its attrs.

    Token ids are checked against the tokenizer's vocabulary, except in stores of the simulated engine,
    whose ids are not a model's tokens; the samples' fingerprints against the policy record's digests.
    """
    vocab = None if store.attrs.simulated else store.attrs.tokenizer.get("vocab_size")
    attrs = store.attrs
    digests = {v.version: digest_number(v.digest) for v in read_versions(store.location) if v.digest}
    return RowRules(
        store.layout,
        int(vocab) if vocab else None,
        attrs.model_tokens_only,
        attrs.logprobs_recorded,
        digests,
        ImageRules.of(attrs, store.location),
    )


def read_chunk(store: GenerationStore, name: str, start: int, stop: int) -> tuple[np.ndarray | None, Problem | None]:
    """Rows ``[start, stop)`` of array ``name`` (one chunk), or the problem if they do not read back."""
    try:
        return store.read_region(start, stop, (name,))[name], None
    except Exception as exc:  # zarr raises ValueError for a checksum, codec errors of many types otherwise
        kind = "checksum" if "checksum" in str(exc).lower() else "decode"
        return None, Problem(kind, name, chunk_key(store, name, start), start, stop, f"{type(exc).__name__}: {exc}")


def check_coarse_chunk(
    store: GenerationStore, name: str, start: int, stop: int
) -> tuple[np.ndarray | None, Problem | None]:
    """Read one chunk of a client-written array; its values are handed back only for ``status`` and ``error``."""
    values, problem = read_chunk(store, name, start, stop)
    return (values if name in ("status", "error") else None), problem


@dataclass(frozen=True)
class PartitionCheck:
    """What reading one partition found: its problems, and the chunks it must have written."""

    problems: list[Problem]
    expected: list[ExpectedChunk]


def check_partition(
    store: GenerationStore,
    start: int,
    done: np.ndarray,
    noted: np.ndarray,
    rules: RowRules,
    texts: dict[str, np.ndarray] | None = None,
) -> PartitionCheck:
    """Read each of one partition's data arrays once; check the invariants of its ``done`` rows and derive the
    chunks they must have written (``noted``: rows whose ``error`` holds a note; ``texts``: the partition's rows
    of each text array known to hold a value, :func:`daskgen.store.tools.expected_chunks.known_texts`)."""
    stop = min(start + store.layout.partition_size, store.layout.n_prompts)
    region: dict[str, np.ndarray] = {}
    problems: list[Problem] = []
    for name in store.layout.data_arrays():
        values, problem = read_chunk(store, name, start, stop)
        if values is not None:
            region[name] = values
        if problem is not None:
            problems.append(problem)
    if problems or not done.any():
        return PartitionCheck(problems, [])
    broken = broken_rows(region, done, rules)
    problems = [
        Problem("invariant", "rows", chunk_key(store, "finish_reason", start), start + r, start + r + 1, why)
        for r, why in sorted(broken.items())
    ]
    chunks = {name: tuple(store.array(name).chunks) for name in region}
    rows = PartitionRows(region, done, noted, rules, texts or {})
    return PartitionCheck(problems, expected_chunks(rows, start, chunks))


def chunk_key(store: GenerationStore, name: str, start: int, index: tuple[int, ...] | None = None) -> str:
    """The key (path in the store) of the chunk of ``name`` at grid ``index`` (default: the first chunk of
    the row ``start``); in a sharded array, the shard's key and the inner chunk's index inside it."""
    arr = store.array(name)
    index = index or (start // arr.chunks[0], *([0] * (len(arr.shape) - 1)))
    if sharding(arr) is None:
        return f"{name}/{arr.metadata.encode_chunk_key(index)}"
    shard, inner = shard_of(arr, index)
    return f"{shard_key(arr, name, shard)} inner chunk {'/'.join(map(str, inner))}"


def missing_chunks(store: GenerationStore, expected: list[ExpectedChunk]) -> list[Problem]:
    """The ``expected`` chunks that are not in the store: no chunk file, or (packed stores) no entry in its
    shard's index.  Each array is listed once, each shard's index read once."""
    gone = "a finished partition's chunk is gone (its rows hold values other than the fill value)"
    listed: dict[str, set[str]] = {}
    indexes: dict[tuple[str, tuple[int, ...]], np.ndarray | None] = {}
    return [
        Problem("missing chunk", e.array, chunk_key(store, e.array, e.start, e.index), e.start, e.stop, gone)
        for e in expected
        if not _present(store, e, listed, indexes)
    ]


def _present(
    store: GenerationStore,
    chunk: ExpectedChunk,
    listed: dict[str, set[str]],
    indexes: dict[tuple[str, tuple[int, ...]], np.ndarray | None],
) -> bool:
    """True when ``chunk``'s file is in the listing of its array, or its shard's index has an entry for it."""
    arr = store.array(chunk.array)
    if sharding(arr) is None:
        if chunk.array not in listed:
            listed[chunk.array] = {key for key, _ in store.location.files(chunk.array)}
        return f"{chunk.array}/{arr.metadata.encode_chunk_key(chunk.index)}" in listed[chunk.array]
    shard, inner = shard_of(arr, chunk.index)
    if (chunk.array, shard) not in indexes:
        indexes[chunk.array, shard] = read_index(store.location, arr, chunk.array, shard)
    index = indexes[chunk.array, shard]
    return index is not None and inner_present(index, inner)


def verify(
    where: StoreRef,
    *,
    scheduler_address: str | None = None,
    progress: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Read every chunk of the store at ``where`` and check its finished rows.

    Parameters
    ----------
    where:
        A store (folder or object-storage URL).
    scheduler_address:
        Run the reads as tasks on this Dask cluster; default: local threads.
    progress:
        Show a progress bar.
    storage_options:
        Object-storage options (credentials stay out of the store).
    """
    store = GenerationStore.open(where, storage_options)
    report = VerifyReport(store.url, store.checksummed)
    status, noted = _coarse_problems(store, report, scheduler_address, progress)
    done = status == DONE
    report.done_rows = int(done.sum())
    rules, size = row_rules(store), store.layout.partition_size
    texts = known_texts(store.attrs)
    report.notes += [texts.note] if texts.note else []
    starts = list(store.layout.partitions())
    jobs = [
        (check_partition, (store, s, done[s : s + size], noted[s : s + size], rules, texts.part(s, s + size)))
        for s in starts
    ]
    expected: list[ExpectedChunk] = []
    for found in _run(jobs, scheduler_address, progress, "partitions"):
        report.problems += found.problems
        expected += found.expected
    report.chunks += len(starts) * len(store.layout.data_arrays())
    report.problems += missing_chunks(store, expected)
    if rules.images is not None:  # every stored image read back and hashed, every reference's file found
        found, notes = stored_image_problems(store.location, storage_options)
        report.problems += [Problem("image", "images", key, 0, 0, why) for key, why in found]
        report.notes += notes
    report.ids = _ids(store, report.rows())
    return report


def _coarse_problems(
    store: GenerationStore, report: VerifyReport, address: str | None, progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Check the coarse-chunked arrays (commit record, coordinates); the status mask they read (the rows of an
    unreadable ``status`` chunk treated as not done) and which rows' ``error`` holds a note."""
    n, coarse = store.layout.n_prompts, store.commit_chunk_rows
    specs = store.layout.array_specs()
    names = [name for name, spec in specs.items() if not spec.worker_written and store.has_array(name)]
    jobs = [(check_coarse_chunk, (store, name, s, min(s + coarse, n))) for name in names for s in range(0, n, coarse)]
    status, noted = np.zeros(n, dtype="int8"), np.zeros(n, dtype=bool)
    for (_, (_, name, s, stop)), (values, problem) in zip(
        jobs, _run(jobs, address, progress, "commit record"), strict=True
    ):
        if problem is not None:
            report.problems.append(problem)
        elif name == "status":
            status[s:stop] = values
        elif name == "error":
            noted[s:stop] = values != ""
    report.chunks += len(jobs)
    return status, noted


def _run(jobs: list[tuple[Callable[..., Any], tuple]], address: str | None, progress: bool, what: str) -> list[Any]:
    """The results of ``fn(*args)`` for every job, in job order; run on a Dask cluster or local threads, with
    a progress bar that advances as they finish."""
    from tqdm.auto import tqdm

    with tqdm(total=len(jobs), desc=f"verifying {what}", disable=not progress, unit="chunk") as bar:
        if address is None:
            with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
                futures = [pool.submit(fn, *args) for fn, args in jobs]
                for _ in concurrent.futures.as_completed(futures):
                    bar.update(1)
                return [f.result() for f in futures]
        from distributed import Client, as_completed

        with Client(address) as client:
            futures = [client.submit(fn, *args, pure=False) for fn, args in jobs]
            for _ in as_completed(futures, loop=client.loop):  # this client's, whatever the default client is
                bar.update(1)
            return client.gather(futures)


def _ids(store: GenerationStore, rows: list[int]) -> dict[int, str]:
    """The input ``id`` of each affected row (empty where ``prompt_id`` itself does not read)."""
    out, coarse = {}, store.commit_chunk_rows
    for start in sorted({r - r % coarse for r in rows}):
        try:
            ids = store.read_region(start, min(start + coarse, store.layout.n_prompts), ("prompt_id",))["prompt_id"]
        except Exception:  # an unreadable prompt_id chunk is itself a reported problem
            continue
        out.update({r: str(ids[r - start]) for r in rows if start <= r < start + coarse})
    return out
