"""``daskgen pack``: rewrite a store into few files (Zarr v3 sharding), and ``daskgen unpack`` back.

A run writes one file per partition per array (a 1M-prompt store has ~140k files), which HPC
inode quotas and Lustre metadata servers punish.  Packing rewrites every array into shards of
about :data:`SHARD_ROWS` prompts (the per-prompt arrays the client writes into shards of
:data:`COARSE_SHARD_ROWS`), keeping the inner chunks partition-sized so a partition still reads
as one small piece.  Packed arrays hold the same values; ``open_store``, xarray, export and
report read them unchanged.

How it stays safe:

* **one writer per shard**: every task copies whole shards (writers sharing a shard lose data,
  docs/storage.md), reads them back and compares them with the source;
* **write beside, verify, swap**: the copy goes to ``STORE.packing`` and only becomes a daskgen
  store (its ``daskgen`` attrs are written) after every shard verified and the commit log's head and
  the followers' cursors were copied; then ``STORE`` is renamed
  to ``STORE.unpacked-old``, ``STORE.packing`` to ``STORE``, and the old copy is deleted.  With
  ``out`` the copy is written to ``out`` and the source is left alone (the only way on object
  storage, which cannot rename);
* **resumable**: the shards already copied are recorded (``daskgen_pack`` attrs of the copy); an
  interrupted pack rewrites only the rest (and any recorded shard that no longer equals the source,
  e.g. after a run on the source in between), and a swap interrupted between its renames is finished;
* the store's lock (:mod:`daskgen.store.records.lock`) is held throughout: no run can write the store meanwhile;
* **damage stays visible**: unpacking copies an inner chunk that does not read back (checksum, decoding)
  as it is stored, so ``daskgen verify`` finds it in the unpacked store and ``--repair`` resets it.

The source is read through its :class:`~daskgen.store.generation_store.GenerationStore` (pickled to the
copy tasks); the copy is written as a plain Zarr group, file by file, since it is no daskgen store until
its attrs are written.

A packed store that still has pending or failed rows cannot be resumed as it is (partitions
share shards): runs refuse it and name the fix, ``daskgen unpack STORE`` (see
:func:`daskgen.store.resumable.check_resumable`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import shutil
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen.errors import PackError
from daskgen.store.attrs import ATTRS_KEY, utc_now
from daskgen.store.chunks.codecs import with_checksum
from daskgen.store.chunks.shard_index import inner_chunk_bytes, sharding
from daskgen.store.commit_log import LOG_KEYS
from daskgen.store.generation_store import GenerationStore, import_zarr
from daskgen.store.identity import not_a_store
from daskgen.store.layout import client_written_arrays
from daskgen.store.location import LocalLocation, StoreLocation, StoreRef, locate
from daskgen.store.records.cursors import Cursor, stored_cursors
from daskgen.store.records.lock import LOCK_NAME, StoreLock
from daskgen.store.tools.pack_cluster import CopyJob, copy_on_clusters

logger = logging.getLogger(__name__)

#: Rows per shard of the partition-chunked (worker-written) arrays, rounded down to whole partitions.
SHARD_ROWS = 65536
#: Rows per shard of the coarse, client-written arrays (``status``, ``error``, coordinates): four
#: chunks of the default ``daskgen.coarse-chunk``.
COARSE_SHARD_ROWS = 4 * 65536
#: Upper bound on a shard's uncompressed size: a task holds one shard in memory.
MAX_SHARD_BYTES = 1 << 30
PROGRESS_KEY = "daskgen_pack"
WORK_SUFFIX, OLD_SUFFIX = ".packing", ".unpacked-old"


@dataclass
class PackResult:
    """What a pack or unpack did."""

    path: str
    mode: str
    files_before: int
    bytes_before: int
    files_after: int
    bytes_after: int
    seconds: float

    def line(self) -> str:
        """One-line summary for the command line."""
        return (
            f"daskgen: {self.mode}ed {self.path}: {self.files_before} files ({self.bytes_before / 2**20:.1f} MiB) "
            f"-> {self.files_after} files ({self.bytes_after / 2**20:.1f} MiB) in {self.seconds:.1f} s"
        )


def shard_rows(chunk_rows: int, row_bytes: int, n_rows: int, *, coarse: bool) -> int:
    """Rows per shard: whole inner chunks, about :data:`SHARD_ROWS` (or the coarse size), within the byte cap."""
    target = COARSE_SHARD_ROWS if coarse else SHARD_ROWS
    rows = max(chunk_rows, target // chunk_rows * chunk_rows)
    cap = max(chunk_rows, MAX_SHARD_BYTES // max(row_bytes, 1) // chunk_rows * chunk_rows)
    whole = -(-n_rows // chunk_rows) * chunk_rows  # no shard larger than the array needs
    return min(rows, cap, whole)


def copy_block(
    src: GenerationStore, dst: StoreLocation, name: str, start: int, stop: int, copied_before: bool = False
) -> int:
    """Copy rows ``[start, stop)`` (whole shards of the target) of array ``name``, then verify them.

    ``copied_before``: an interrupted pack recorded this block; it is only rewritten if it differs
    from the source now (a run may have changed the source in between).  Runs on a Dask worker;
    returns the bytes written (uncompressed).
    """
    try:
        values = src.read_region(start, stop, (name,))[name]
    except Exception:  # a checksum or decoding failure: zarr raises many types
        if not src.attrs.packed:
            raise
        return copy_damaged_block(src, dst, name, start, stop)
    target = import_zarr().open_array(dst.zarr_store(), path=name, mode="r+")
    if copied_before and _same(values, target[start:stop]):
        return 0
    target[start:stop] = values
    if not _same(values, target[start:stop]):
        raise _verification_error(dst, name, start, stop)
    return int(values.nbytes)


def copy_damaged_block(src: GenerationStore, dst: StoreLocation, name: str, start: int, stop: int) -> int:
    """Unpack rows ``[start, stop)`` of ``name`` that do not read back: row chunk by row chunk, the inner
    chunks of one that does not read copied as they are stored (still damaged, so ``daskgen verify`` finds
    them in the unpacked store and ``--repair`` resets their partitions).  Returns the bytes copied."""
    arr, rows = src.array(name), src.array(name).chunks[0]
    target = import_zarr().open_array(dst.zarr_store(), path=name, mode="r+")
    codec = sharding(arr)
    if codec is None or tuple(codec.codecs) != tuple(target.metadata.codecs):
        raise PackError(f"cannot copy the damaged rows {start}..{stop - 1} of {name!r}: the target's codecs differ")
    copied = 0
    for lo in range(start, stop, rows):
        hi = min(lo + rows, stop)
        try:
            values = src.read_region(lo, hi, (name,))[name]
        except Exception as exc:
            logger.warning("rows %d..%d of %r do not read (%s): copied as stored", lo, hi - 1, name, exc)
            copied += _copy_stored(src, dst, target, name, lo // rows)
            continue
        target[lo:hi] = values
        copied += int(values.nbytes)
    return copied


def _copy_stored(src: GenerationStore, dst: StoreLocation, target: Any, name: str, row_chunk: int) -> int:
    """Copy every inner chunk of grid row ``row_chunk`` of the packed ``name`` into ``target``'s chunk files,
    byte for byte; returns the bytes copied."""
    arr, copied = src.array(name), 0
    others = [range(-(-size // step)) for size, step in zip(arr.shape[1:], arr.chunks[1:], strict=True)]
    for index in itertools.product([row_chunk], *others):
        data = inner_chunk_bytes(src.location, arr, name, index)
        if data is not None:
            dst.write_object(f"{name}/{target.metadata.encode_chunk_key(index)}", data)
            copied += len(data)
    return copied


def _verification_error(dst: StoreLocation, name: str, start: int, stop: int) -> PackError:
    """The error for a copied block that reads back different from the source."""
    return PackError(
        f"verification failed: rows {start}..{stop - 1} of {name!r} in {dst.url!r} differ from "
        f"the source after copying. The source is untouched; rerun to retry."
    )


def _same(a: np.ndarray, b: Any) -> bool:
    b = np.asarray(b)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


def plan_arrays(src: GenerationStore, packing: bool) -> dict[str, dict[str, Any]]:
    """name -> create_array arguments of the target (same values, sharded or not)."""
    client_written = client_written_arrays()
    return {name: _array_plan(src.array(name), packing, coarse=name in client_written) for name in src.array_names()}


def _array_plan(arr: Any, packing: bool, coarse: bool) -> dict[str, Any]:
    """The target's ``create_array`` arguments for ``arr``, plus ``step``: the rows one copy task moves.

    Packing shards the array (``coarse``: client-written arrays get larger shards); unpacking drops shards.
    """
    inner = arr.chunks
    n, rows = arr.shape[0], inner[0]
    row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * max(arr.dtype.itemsize, 8)
    shards = (shard_rows(rows, row_bytes, n, coarse=coarse), *arr.shape[1:]) if packing else None
    return {
        "shape": arr.shape,
        "chunks": inner,
        "shards": shards,
        "dtype": arr.metadata.data_type,
        "fill_value": arr.metadata.fill_value,
        "dimension_names": arr.metadata.dimension_names,
        "compressors": with_checksum(arr.compressors),
        "attributes": arr.attrs.asdict(),
        "step": shards[0] if shards else (arr.shards or inner)[0],
    }


def copy_tasks(plans: dict[str, dict[str, Any]]) -> list[tuple[str, int, int]]:
    """One ``(array, start, stop)`` copy task per target shard (packing) or source block (unpacking)."""
    return [
        (name, start, min(start + p["step"], p["shape"][0]))
        for name, p in plans.items()
        for start in range(0, p["shape"][0], p["step"])
    ]


def prepare_target(src: StoreLocation, dst: StoreLocation, plans: dict[str, dict[str, Any]], mode: str) -> set[str]:
    """Create the target's arrays (or reopen a pack in progress); returns the blocks already copied."""
    zarr = import_zarr()
    if not dst.is_empty():
        return _resume_target(src, dst, plans, mode)
    group = zarr.open_group(dst.zarr_store(), mode="w-", zarr_format=3)
    for name, p in plans.items():
        group.create_array(name, **{k: v for k, v in p.items() if k != "step"})
    group.attrs[PROGRESS_KEY] = {"source": src.url, "mode": mode, "done": []}
    return set()


def _resume_target(src: StoreLocation, dst: StoreLocation, plans: dict[str, dict[str, Any]], mode: str) -> set[str]:
    """The blocks already copied into an existing target: an interrupted copy, or a finished one never swapped in.

    Raises :class:`PackError` when the target is something else.
    """
    progress = _read_progress(dst)
    finished = GenerationStore.open_if_exists(dst) if progress is None and dst == src.sibling(WORK_SUFFIX) else None
    if finished is not None and bool(finished.attrs.packed) == (mode == "pack"):
        logger.info("%s is a finished %s of %s that was not swapped in: re-checking it", dst.url, mode, src.url)
        return {f"{name}/{start}" for name, start, _ in copy_tasks(plans)}  # every block re-checked, then swap
    if not progress or progress.get("source") != src.url or progress.get("mode") != mode:
        raise PackError(
            f"the output {dst.url!r} exists and is not an interrupted {mode} of {src.url!r}; "
            "remove it or choose another --out."
        )
    logger.info("resuming the %s into %s: %d blocks already copied", mode, dst.url, len(progress["done"]))
    return set(progress["done"])


def _read_progress(dst: StoreLocation) -> dict[str, Any] | None:
    """The copy progress recorded in the target's root attrs, or ``None`` when there is none."""
    import json

    raw = dst.read_bytes("zarr.json")
    if raw is None:
        return None
    return (json.loads(raw).get("attributes") or {}).get(PROGRESS_KEY)


def record_progress(dst: StoreLocation, done: set[str], src: StoreLocation, mode: str) -> None:
    """Write the blocks copied so far into the target's attributes (a pack resumes from them)."""
    group = import_zarr().open_group(dst.zarr_store(), mode="r+")
    group.attrs[PROGRESS_KEY] = {"source": src.url, "mode": mode, "done": sorted(done)}


def _finish(src: GenerationStore, dst: StoreLocation, plans: dict[str, dict[str, Any]], mode: str) -> None:
    """Check the copy as a whole, then make it a daskgen store (its attrs are written last)."""
    zarr, attrs = import_zarr(), copy.copy(src.attrs)  # the source keeps its own
    group = zarr.open_group(dst.zarr_store(), mode="r+")
    _check_copy(src, dst, group, plans, mode)
    if mode == "pack":
        shards = {n: p["shards"][0] for n, p in plans.items()}
        attrs.packed = {"shard_rows": shards, "read_rows": min(shards.values()), "packed": utc_now()}
    else:
        attrs.packed = None
    _copy_log_objects(src.location, dst)
    group.attrs.update({ATTRS_KEY: attrs.to_json()})
    if PROGRESS_KEY in group.attrs:
        del group.attrs[PROGRESS_KEY]
    zarr.consolidate_metadata(dst.zarr_store())


def _copy_log_objects(src: StoreLocation, dst: StoreLocation) -> None:
    """Copy the commit log's head and the followers' cursors (``daskgen.commits``, ``daskgen.cursors/``)."""
    for key, _ in src.files():
        if key.split("/", 1)[0] in LOG_KEYS:
            data = src.read_bytes(key)
            if data is not None:
                dst.write_object(key, data)


def _check_copy(
    src: GenerationStore, dst: StoreLocation, group: Any, plans: dict[str, dict[str, Any]], mode: str
) -> None:
    """Raise :class:`PackError` unless every target array has its planned shape and the checkpoints agree."""
    for name, p in plans.items():
        if group[name].shape != p["shape"]:
            raise PackError(f"array {name!r} of {dst.url!r} has shape {group[name].shape}, expected {p['shape']}")
    if not np.array_equal(src.read_status(), np.asarray(group["status"][:])):
        raise PackError(f"the checkpoint of {dst.url!r} differs from {src.url!r}; rerun the {mode}.")


def swap_in(src: LocalLocation, work: LocalLocation) -> None:
    """``src`` -> ``src.unpacked-old``, ``work`` -> ``src``, delete the old copy (each step resumable)."""
    old = src.sibling(OLD_SUFFIX)
    if src.path.exists():
        src.path.rename(old.path)
    work.path.rename(src.path)
    _keep_newer_cursors(old, src)
    shutil.rmtree(old.path)


def _keep_newer_cursors(old: StoreLocation, new: StoreLocation) -> None:
    """Carry over the cursors a follower acknowledged in the old store after they were copied (the ack
    landed there between the copy and the swap): a cursor that acknowledged more batches, or is further on in
    commit order, replaces the copy's."""
    for name, state in stored_cursors(old):
        copied = Cursor(new, name).load()
        if (state.batches, state.position) > (copied.batches, copied.position):
            Cursor(new, name).save(state)


def _finish_interrupted_swap(src: StoreLocation) -> bool:
    """Complete a swap that stopped between its renames; True when there was one."""
    if not isinstance(src, LocalLocation) or src.path.exists():
        return False
    work, old = src.sibling(WORK_SUFFIX), src.sibling(OLD_SUFFIX)
    if old.path.is_dir() and GenerationStore.open_if_exists(work) is not None:
        swap_in(src, work)
        return True
    return False


def _size(loc: StoreLocation) -> tuple[int, int]:
    sizes = [s for k, s in loc.files() if not k.endswith(LOCK_NAME)]
    return len(sizes), sum(sizes)


def pack(
    path: StoreRef,
    out: StoreRef | None = None,
    *,
    unpack: bool = False,
    scheduler_address: str | None = None,
    n_workers: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> PackResult:
    """Pack (or with ``unpack`` unpack) the store at ``path``, in place or into ``out``.

    Copies run as Dask tasks on ``scheduler_address`` or on a LocalCluster of ``n_workers``
    (:mod:`daskgen.store.tools.pack_cluster`: a copy that stalls there gets a new local cluster once).
    """
    mode = "unpack" if unpack else "pack"
    t0 = time.perf_counter()
    src = locate(path, storage_options)
    if _finish_interrupted_swap(src):
        files, size = _size(src)
        return PackResult(src.url, mode, files, size, files, size, time.perf_counter() - t0)
    source = GenerationStore.open_if_exists(src)
    if source is None:
        raise PackError(f"{not_a_store(src)} Pass the --store path of a daskgen run.")
    if bool(source.attrs.packed) != unpack:
        state = "already packed" if not unpack else "not packed"
        raise PackError(f"{src.url!r} is {state}; nothing to {mode}.")
    if out is None and not src.is_local:
        raise PackError(
            f"{src.url!r} is on object storage, which cannot rename: pass --out with a new location "
            f"(e.g. {src.url}.packed) to {mode} into it."
        )
    dst = src.sibling(WORK_SUFFIX) if out is None else locate(out, storage_options)
    files_before, bytes_before = _size(src)
    with StoreLock(src):
        plans = plan_arrays(source, packing=not unpack)
        done = prepare_target(src, dst, plans, mode)
        record = functools.partial(record_progress, dst, src=src, mode=mode)
        job = CopyJob(functools.partial(copy_block, source, dst), copy_tasks(plans), done, record, mode, dst.url)
        copy_on_clusters(job, scheduler_address, n_workers)
        _finish(source, dst, plans, mode)
        if out is None:
            swap_in(src, dst)  # type: ignore[arg-type]
    final = src if out is None else dst
    files_after, bytes_after = _size(final)
    return PackResult(final.url, mode, files_before, bytes_before, files_after, bytes_after, time.perf_counter() - t0)
