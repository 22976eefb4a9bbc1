"""Regions handed to writer processes through shared memory (:mod:`daskgen.worker.writers.shared_regions`).

In one process: a region's arrays come back equal from their block (text arrays pickled beside it), blocks are
reused and removed on close, a block read by a write is not reused before the write ends, and a shared-memory
folder without room sends the region pickled.  Writer processes reading the blocks for real:
``tests/test_writers.py``; here one writer process gets a region both ways.
"""

from __future__ import annotations

import asyncio
import os
from collections import namedtuple

import numpy as np
import pytest

from daskgen.worker.writers import shared_regions
from daskgen.worker.writers.shared_regions import Handover, SharedBlocks, arrays_of


def region(rows: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """A small region of each kind of array a partition writes: ints, floats, bools, text."""
    rng = np.random.default_rng(seed)
    return {
        "response_ids": rng.integers(0, 50_000, size=(rows, 2, 16), dtype=np.int32),
        "logprobs": rng.standard_normal((rows, 2, 16)).astype(np.float32),
        "response_mask": rng.integers(0, 2, size=(rows, 2, 16), dtype=np.int8),
        "finish_reason": rng.integers(0, 4, size=(rows, 2), dtype=np.uint8),
        "flags": rng.integers(0, 2, size=(rows,)).astype(bool),
        "col_source": np.array([f"doc {i}" for i in range(rows)], dtype=object),
    }


def on_disk(name: str) -> bool:
    """Whether the block ``name`` still exists (Linux keeps POSIX shared memory as files in /dev/shm)."""
    return os.path.exists(os.path.join("/dev/shm", name))


def test_a_region_comes_back_equal_and_its_text_goes_pickled():
    blocks = SharedBlocks(keep=1)
    arrays = region()
    shared, block = blocks.share(arrays)
    try:
        back = arrays_of(shared)
        assert set(back) == set(arrays)
        for name, values in arrays.items():
            assert back[name].dtype == values.dtype and back[name].shape == values.shape, name
            np.testing.assert_array_equal(back[name], values, err_msg=name)
        assert set(shared.others) == {"col_source"}  # text is not put in the block
        assert not any(np.shares_memory(back[n], arrays[n]) for n in shared.places)  # copied, not aliased
        del back
    finally:
        blocks.drop(block)
        blocks.close()
    assert blocks.shared == 1 and blocks.pickled == 0


def test_blocks_are_reused_and_removed_on_close():
    blocks = SharedBlocks(keep=1)
    first, block = blocks.share(region(seed=1))
    blocks.drop(block)
    second, again = blocks.share(region(rows=3, seed=2))  # a smaller region fits the kept block
    assert second.block == first.block and again is block
    np.testing.assert_array_equal(arrays_of(second)["response_ids"], region(rows=3, seed=2)["response_ids"])
    blocks.drop(again)
    assert on_disk(first.block)
    blocks.close()
    assert not on_disk(first.block)


def test_a_block_read_by_a_write_is_not_reused_before_the_write_ends():
    blocks = SharedBlocks(keep=2)
    shared, block = blocks.share(region(seed=3))
    blocks.hold(block)  # a write that reads it was submitted
    blocks.drop(block)  # the task awaiting the write was cancelled: its own hold ends
    other, other_block = blocks.share(region(seed=4))
    assert other.block != shared.block  # the write may still be reading the first block
    np.testing.assert_array_equal(arrays_of(shared)["logprobs"], region(seed=3)["logprobs"])
    blocks.drop(block)  # the write ended
    blocks.drop(other_block)
    third, third_block = blocks.share(region(seed=5))
    assert third.block in (shared.block, other.block)
    blocks.drop(third_block)
    blocks.close()
    assert not on_disk(shared.block) and not on_disk(other.block)


def test_beyond_the_kept_blocks_a_free_block_is_removed():
    blocks = SharedBlocks(keep=1)
    (a, block_a), (b, block_b) = blocks.share(region(seed=6)), blocks.share(region(seed=7))
    blocks.drop(block_a)
    blocks.drop(block_b)  # one block is kept: the second is removed at once
    assert on_disk(a.block) != on_disk(b.block)
    blocks.close()
    assert not on_disk(a.block) and not on_disk(b.block)


def test_without_room_in_the_shared_memory_folder_the_region_goes_pickled(monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shared_regions.shutil, "disk_usage", lambda path: Usage(64 << 20, 64 << 20, 1000))
    blocks = SharedBlocks(keep=1)
    assert blocks.share(region()) is None
    assert blocks.pickled == 1 and blocks.shared == 0
    monkeypatch.undo()
    shared, block = blocks.share(region())
    blocks.drop(block)
    blocks.close()
    assert blocks.shared == 1 and not on_disk(shared.block)


def test_a_hand_over_dropped_unwritten_gives_its_block_back():
    """A task cancelled between placing its region and writing it drops its hand-over: the block is reused."""
    blocks = SharedBlocks(keep=1)
    handover = Handover(blocks, region(seed=8))
    assert handover.region is not None and handover.arrays is None
    name = handover.region.block
    del handover  # never written
    again = Handover(blocks, region(seed=9))
    assert again.region is not None and again.region.block == name
    np.testing.assert_array_equal(arrays_of(again.region)["response_ids"], region(seed=9)["response_ids"])
    again.release()
    again.release()  # released once only
    blocks.close()
    assert not on_disk(name)


def test_a_hand_over_without_room_keeps_its_arrays(monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shared_regions.shutil, "disk_usage", lambda path: Usage(64 << 20, 64 << 20, 1000))
    arrays = region()
    handover = Handover(SharedBlocks(keep=1), arrays)
    assert handover.region is None and handover.arrays is arrays
    handover.release()


class FileStore:
    """A stand-in store whose region write saves the arrays to a file (the writer process runs it)."""

    def __init__(self, path: str):
        self.path = path

    def write_region(self, start: int, arrays: dict[str, np.ndarray]) -> None:
        np.savez(self.path, start=start, **arrays)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("room", [True, False])
def test_a_writer_process_writes_the_region_in_shared_memory_or_pickled(tmp_path, monkeypatch, room):
    """Through a real writer process: the same arrays arrive whichever way the region went."""
    from daskgen.worker.writers.pool import WriterPool

    if not room:
        Usage = namedtuple("Usage", "total used free")
        monkeypatch.setattr(shared_regions.shutil, "disk_usage", lambda path: Usage(64 << 20, 64 << 20, 1000))
    pool, arrays = WriterPool(1), region(seed=10)
    try:
        asyncio.run(pool.write_region(FileStore(str(tmp_path / "out.npz")), 8, arrays))
    finally:
        pool.close()
    with np.load(tmp_path / "out.npz", allow_pickle=True) as written:
        assert int(written["start"]) == 8
        for name, values in arrays.items():
            np.testing.assert_array_equal(written[name], values, err_msg=name)
    assert (pool.blocks.shared, pool.blocks.pickled) == ((1, 0) if room else (0, 1))
