"""The store object: one daskgen store, opened once, through which every read and write goes.

:class:`GenerationStore` is opened from a location (:meth:`GenerationStore.open`) or created
(:meth:`GenerationStore.create`); it holds the location, the typed attrs (:class:`StoreAttrs`, with the
:class:`Layout`) and the Zarr arrays it has opened.  Workers write whole chunk-aligned regions of the
data arrays (:meth:`GenerationStore.write_region`) through a store opened once per worker process
(pickled as its location and :attr:`GenerationStore.version`); only the client commits
(:meth:`GenerationStore.commit`: ``error``, ``committed_at`` and ``commit_seq`` first, then ``status``,
then the commit log's head, :mod:`daskgen.store.commit_log`), after the data landed.  ``status`` is the
checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from daskgen.errors import StoreError, StoreWriteError
from daskgen.store.attrs import ATTRS_KEY, StoreAttrs, jsonable, utc_now
from daskgen.store.chunks.chunk_reads import PlainArray, plain_array
from daskgen.store.chunks.codecs import chunks_checksummed, compressors
from daskgen.store.commit_log import write_head
from daskgen.store.identity import not_a_store, read_store_attrs, version_of
from daskgen.store.images import IMAGES_FOLDER
from daskgen.store.layout import (
    COORDS,
    DATA_ARRAYS,
    WORKER_ARRAYS,
    ArraySpec,
    Layout,
    variable_attrs,
)
from daskgen.store.location import LocalLocation, StoreLocation, StoreRef, describe_failure, locate, write_failures
from daskgen.store.records.cursors import CursorState, stored_cursors
from daskgen.store.records.lock import LOCK_NAME

#: The client-written arrays of the commit record, in the order a commit writes them (``status`` last).
COMMIT_ARRAYS = ("committed_at", "error", "commit_seq", "status")
#: What a failed write leaves and how to go on.
WRITE_ADVICE = (
    "Finished work is saved (each chunk is replaced atomically); free disk space, fix permissions (or the object "
    "store's credentials or connection), then rerun the same command to resume."
)
#: What a failed read leaves and how to go on.
READ_ADVICE = (
    "Nothing was lost: check the disk, or the object store's connection and credentials, then rerun the same "
    "command to resume."
)


def import_zarr() -> Any:
    """The ``zarr`` module, with the warnings daskgen's stores trigger by design silenced."""
    import zarr

    warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")
    # the store's own records and its image objects sit beside the arrays: zarr lists them as unknown objects
    known = rf"daskgen\.(lock|commits|cursors|policy[.a-z]*)|{IMAGES_FOLDER}"
    warnings.filterwarnings("ignore", message=rf".*Object at ({known}) is not recognized.*")
    return zarr


class GenerationStore:
    """One daskgen store: its location, typed attrs and layout, and every read and write of its arrays.

    Parameters
    ----------
    location:
        Where the store lives (:func:`daskgen.store.location.locate`).
    attrs:
        Its ``daskgen`` attrs, as read when it was opened; ``None``: read at their first use, and refused unless
        the store there has ``version`` (a store unpickled in a worker, :meth:`__reduce__`).
    version:
        With ``attrs=None``: the :attr:`version` the store must still have.
    """

    def __init__(self, location: StoreLocation, attrs: StoreAttrs | None, version: str = "") -> None:
        self.location = location
        self._attrs = attrs
        self._expected_version = version
        self._arrays: dict[tuple[str, bool], Any] = {}
        self._plain_arrays: dict[str, PlainArray | None] = {}

    @property
    def attrs(self) -> StoreAttrs:
        """The typed attrs (:class:`StoreAttrs`); a store unpickled without them reads them here, once."""
        if self._attrs is None:
            self._attrs = self._read_unpickled_attrs()
        return self._attrs

    @attrs.setter
    def attrs(self, value: StoreAttrs) -> None:
        self._attrs = value

    def _read_unpickled_attrs(self) -> StoreAttrs:
        """The attrs of the store at this location, refused unless it is still the store that was pickled."""
        with self.read_errors(f"reading the attrs (zarr.json) {_where_this_runs()}"):
            found = read_store_attrs(self.location)
        if found is None:
            raise StoreError(f"{self.url!r} no longer holds a daskgen store (its zarr.json lost the attrs)")
        if self._expected_version and version_of(found) != self._expected_version:
            raise StoreError(
                f"store {self.url!r} changed while this run used it (expected {self._expected_version!r}, found "
                f"{version_of(found)!r}): another process replaced, packed or unpacked it. Rerun to resume from what "
                "it holds now."
            )
        return found

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, where: StoreRef, storage_options: dict[str, Any] | None = None) -> GenerationStore:
        """Open an existing store; :class:`StoreError` when ``where`` holds no daskgen store."""
        store = cls.open_if_exists(where, storage_options)
        if store is None:
            raise StoreError(
                f"{not_a_store(locate(where, storage_options))} Check the path (the --store of a daskgen run), or run "
                "`daskgen run --store PATH` to create one."
            )
        return store

    @classmethod
    def open_if_exists(cls, where: StoreRef, storage_options: dict[str, Any] | None = None) -> GenerationStore | None:
        """Open the store at ``where``, or ``None`` when there is none yet."""
        loc = locate(where, storage_options)
        attrs = read_store_attrs(loc)
        return None if attrs is None else cls(loc, attrs)

    @property
    def version(self) -> str:
        """What identifies this store's arrays at its location: creation time and packing state."""
        if self._attrs is None and self._expected_version:
            return self._expected_version
        return version_of(self.attrs)

    @classmethod
    def create(cls, where: StoreRef, attrs: StoreAttrs, prompt_ids: list[str]) -> GenerationStore:
        """Create an empty store: every array of ``attrs.layout``, the coordinates, attrs, consolidated metadata."""
        zarr, loc = import_zarr(), locate(where)
        if not loc.is_empty():
            kind = "a file" if loc.is_file() else "a non-empty location that is not a daskgen store"
            raise StoreError(f"cannot create a store at {loc.url!r}: it is {kind}. Pass a new --store path.")
        group = zarr.open_group(loc.zarr_store(), mode="w-", zarr_format=3)
        for name, spec in attrs.layout.array_specs().items():
            _create_array(group, name, spec)
        group["prompt_index"][:] = np.arange(attrs.layout.n_prompts, dtype="int64")
        group["prompt_id"][:] = np.array(prompt_ids, dtype=object).astype(str)
        attrs.schema_version, attrs.created = attrs.layout.schema_version, utc_now()
        group.attrs[ATTRS_KEY] = attrs.to_json()
        zarr.consolidate_metadata(loc.zarr_store())
        return cls(loc, attrs)

    @property
    def layout(self) -> Layout:
        """The store's :class:`Layout` (fixed at creation)."""
        return self.attrs.layout

    @property
    def url(self) -> str:
        """The store's location as text (a folder or an object-storage URL)."""
        return self.location.url

    def __repr__(self) -> str:
        return f"GenerationStore({self.url!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its location and :attr:`version`, and unpickled without reading anything: Dask unpickles
        tasks in its connections (scheduler and workers), where a store that cannot be reached would break the
        connection instead of failing the task.  A process keeps one such store per location and version, which
        reads its attrs at their first use (refused if the store there was replaced meanwhile: a new run into a
        deleted folder, ``daskgen pack``/``unpack``); a failed read is tried again at the next use."""
        return (_unpickled, (self.location, self.version))

    @property
    def checksummed(self) -> bool:
        """True when every array checksums its chunks (stores made before checksums existed do not)."""
        names = [name for name in self.layout.array_specs() if self.has_array(name)]  # older stores lack newer arrays
        return all(chunks_checksummed(self.array(name).metadata.codecs) for name in names)

    def array(self, name: str, *, writable: bool = False) -> Any:
        """The Zarr array ``name``, opened once for this store object."""
        key = (name, writable)
        if key not in self._arrays:
            _ = self.attrs  # an unpickled store checks it is still the pickled one before its first array
            target = self.location.zarr_store(read_only=not writable)
            self._arrays[key] = import_zarr().open_array(target, path=name, mode="r+" if writable else "r")
        return self._arrays[key]

    # --- reading -------------------------------------------------------------------------------
    def read_status(self) -> np.ndarray:
        """The whole checkpoint mask (coarse chunks: fast even for millions of rows)."""
        with self.read_errors("reading status"):
            return np.asarray(self.array("status")[:])

    def read_region(self, start: int, stop: int, names: tuple[str, ...] = DATA_ARRAYS) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` of the named arrays."""
        return {name: parts[0] for name, parts in self.read_spans([(start, stop)], names).items()}

    def read_spans(self, spans: list[tuple[int, int]], names: tuple[str, ...]) -> dict[str, list[np.ndarray]]:
        """Rows ``[start, stop)`` of each span of the named arrays: name -> one array per span.

        The plain arrays of a local store are read chunk file by chunk file (:mod:`daskgen.store.chunks.chunk_reads`);
        every other (array, span) read is issued at once on Zarr's event loop, so their chunks are fetched and
        decoded side by side (decoding releases the GIL) in one hand-over, not one per array and span.
        """
        if not spans:
            return {name: [] for name in names}
        import asyncio

        from zarr.core.sync import sync

        what = f"reading rows {spans[0][0]}..{spans[-1][1] - 1} ({len(spans)} span(s)) of {', '.join(names)}"
        plain = {name: self._plain(name) for name in names}
        rest = [name for name in names if plain[name] is None]
        arrays = [self.array(name).async_array for name in rest]

        async def gather() -> list[Any]:
            return await asyncio.gather(*(a.getitem(slice(lo, hi)) for a in arrays for lo, hi in spans))

        with self.read_errors(what):
            out = {name: [p.read(lo, hi) for lo, hi in spans] for name, p in plain.items() if p is not None}
            values = sync(gather()) if rest else []
        k = len(spans)
        out |= {name: [np.asarray(v) for v in values[i * k : (i + 1) * k]] for i, name in enumerate(rest)}
        return {name: out[name] for name in names}

    def _plain(self, name: str) -> PlainArray | None:
        """How to read array ``name`` chunk file by chunk file (a plain array of a local store), else ``None``."""
        if name not in self._plain_arrays:
            where = self.location
            folder = where.path / name if isinstance(where, LocalLocation) else None
            self._plain_arrays[name] = None if folder is None else plain_array(folder, self.array(name))
        return self._plain_arrays[name]

    def array_names(self) -> list[str]:
        """Names of every array the store holds (its layout's, as far as it has them, and any other)."""
        group = import_zarr().open_group(self.location.zarr_store(read_only=True), mode="r")
        return sorted(group.array_keys())

    def dataset(self) -> Any:
        """The store as a lazy ``xarray.Dataset`` (one dask chunk per shard of a packed store: each shard file is
        read once)."""
        import xarray as xr

        rows = (self.attrs.packed or {}).get("read_rows")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return xr.open_zarr(self.location.zarr_store(read_only=True), chunks={"prompt": rows} if rows else {})

    def object_keys(self) -> list[str]:
        """Every object of the store (Zarr metadata and chunks, the commit log, cursors) but its lock, sorted."""
        return sorted(key for key, _ in self.location.files() if key.rsplit("/", 1)[-1] != LOCK_NAME)

    def read_object(self, key: str) -> bytes | None:
        """The object ``key`` of :meth:`object_keys` as it is now (``None``: deleted meanwhile)."""
        return self.location.read_bytes(key)

    def cursors(self) -> list[tuple[str, CursorState]]:
        """The followers' cursors kept inside the store, by name (:mod:`daskgen.store.records.cursors`)."""
        return stored_cursors(self.location)

    def refresh_attrs(self) -> StoreAttrs:
        """Re-read the attrs (another process, e.g. a running client, may have changed them)."""
        found = read_store_attrs(self.location)
        if found is None:
            raise StoreError(f"{self.url!r} no longer holds a daskgen store (its zarr.json lost the attrs)")
        self.attrs = found
        return found

    # --- writing -------------------------------------------------------------------------------
    def write_region(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Worker side: overwrite one chunk-aligned row region of each given data array.

        The arrays are written side by side, ``finish_reason`` after all the others have landed: a later attempt
        keeps a stored sample on the strength of its finish reason (:mod:`daskgen.worker.samples.continuation`), so a
        writer killed part-way through the region must not leave a finish reason beside arrays it never wrote.
        """
        for name in arrays:
            if name not in WORKER_ARRAYS and name not in self.layout.data_arrays():
                raise StoreError(f"workers may only write data arrays {self.layout.data_arrays()}, not {name!r}")
        rest = dict(arrays)
        last = {"finish_reason": rest.pop("finish_reason")} if "finish_reason" in rest else {}
        for group in (rest, last):
            if group:
                self._write_side_by_side(start, group)

    def _write_side_by_side(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        """Write each array's rows from ``start`` in one hand-over to Zarr's event loop (their chunks encoded and
        stored side by side); the first failure is raised once every write has ended."""
        import asyncio

        from zarr.core.sync import sync

        targets = [(self.array(name, writable=True).async_array, values) for name, values in arrays.items()]

        async def write() -> None:
            writes = (array.setitem(slice(start, start + len(values)), values) for array, values in targets)
            failed = [e for e in await asyncio.gather(*writes, return_exceptions=True) if e is not None]
            if failed:
                raise failed[0]

        rows = f"rows {start}..{start + len(targets[0][1]) - 1}"
        with self.write_errors(f"writing {rows} of {', '.join(arrays)}"):
            sync(write())

    @property
    def commit_chunk_rows(self) -> int:
        """Rows per chunk of ``status`` (``daskgen.coarse-chunk`` when the store was created)."""
        return int(self.array("status").chunks[0])

    def commit(
        self,
        start: int,
        status: np.ndarray,
        errors: list[str] | None,
        committed_at: np.ndarray | None = None,
        seq: np.ndarray | None = None,
        head: int | None = None,
    ) -> None:
        """Client only: record rows' outcome.  ``committed_at``, ``error`` and ``commit_seq`` (``seq``) first,
        then ``status`` (the commit), then the commit log's head (``head``: this commit's sequence number).

        A range covering whole coarse chunks is written without reading them first.
        """
        stop = start + len(status)
        with self.write_errors(f"committing rows {start}..{stop - 1}"):
            if committed_at is not None:
                self.array("committed_at", writable=True)[start:stop] = committed_at
            if errors is not None:
                self.array("error", writable=True)[start:stop] = np.array(errors, dtype=object).astype(str)
            if seq is not None and self.has_array("commit_seq"):
                self.array("commit_seq", writable=True)[start:stop] = seq
            self.array("status", writable=True)[start:stop] = status.astype("int8")
            if head is not None:
                write_head(self.location, head)

    def has_array(self, name: str) -> bool:
        """True when the store holds the array ``name`` (stores from older versions lack newer arrays)."""
        try:
            self.array(name)
        except (KeyError, FileNotFoundError, LookupError):
            return False
        return True

    def write_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn OS and object-storage write failures into :class:`StoreWriteError` naming the store and the fix."""
        return self._failures_as(StoreWriteError, what, WRITE_ADVICE)

    def read_errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Turn OS and object-storage read failures (after the client's own retries) into :class:`StoreError`."""
        return self._failures_as(StoreError, what, READ_ADVICE)

    @contextlib.contextmanager
    def _failures_as(self, error: type[StoreError], what: str, advice: str) -> Iterator[None]:
        try:
            yield
        except write_failures() as exc:
            raise error(f"{what} of store {self.url!r} failed: {describe_failure(exc)}. {advice}") from exc

    def update_attrs(self, **updates: Any) -> None:
        """Set fields of the attrs (client only, under the lock) and re-consolidate the metadata."""
        for key, value in updates.items():
            if not hasattr(self.attrs, key) or key == "extra":
                raise StoreError(f"{key!r} is not a field of the store attrs ({type(self.attrs).__name__})")
            setattr(self.attrs, key, value)
        self._write_attrs()

    def append_run(self, record: dict[str, Any]) -> None:
        """Append one invocation's summary to the run history."""
        self.attrs.runs = [*self.attrs.runs, jsonable({**record, "finished": utc_now()})]
        self._write_attrs()

    def _write_attrs(self) -> None:
        zarr, target = import_zarr(), self.location.zarr_store()
        with self.write_errors("writing the attrs (run history, settings)"):
            group = zarr.open_group(target, mode="r+")
            group.attrs[ATTRS_KEY] = self.attrs.to_json()
            zarr.consolidate_metadata(target)

    def add_missing_arrays(self) -> list[str]:
        """Create arrays of the layout that an older store lacks (client only, under the lock).

        Stores written before ``continued_tokens`` existed gain it (all zeros) when a run resumes them.
        Returns the names added.
        """
        zarr, target = import_zarr(), self.location.zarr_store()
        group = zarr.open_group(target, mode="r+")
        specs = self.layout.array_specs()
        missing = [name for name in specs if name not in group]
        for name in missing:
            _create_array(group, name, specs[name])
        if missing:
            zarr.consolidate_metadata(target)
        return missing


def _where_this_runs() -> str:
    """``on worker ADDRESS`` in a Dask worker's task, else ``on host NAME (pid N)``: where a store was unpickled."""
    try:
        from distributed import get_worker

        return f"on worker {get_worker().address}"
    except (ImportError, ValueError):
        return f"on host {socket.gethostname()} (pid {os.getpid()})"


@functools.lru_cache(maxsize=16)
def _unpickled(location: StoreLocation, version: str) -> GenerationStore:
    return GenerationStore(location, None, version)


def _create_array(group: Any, name: str, spec: ArraySpec) -> None:
    extra = {} if spec.role == "coordinate" else {"coordinates": COORDS}
    group.create_array(
        name,
        shape=spec.shape,
        chunks=spec.chunks,
        dtype=str if spec.dtype == "str" else spec.dtype,
        fill_value=spec.fill,
        dimension_names=list(spec.dims),
        compressors=compressors(),
        attributes={**variable_attrs(name), **extra},
    )
