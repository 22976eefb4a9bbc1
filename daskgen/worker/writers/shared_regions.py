"""A finished region handed to a writer process through shared memory instead of a pipe.

A partition's region is padded to the store's widths, so it is mostly fill values: with 64 prompts × 4 samples
of 512 tokens and logprobs on, 1.2 MB of which a few percent are tokens.  Pickled to a writer process, those bytes
are copied into a pipe by the worker, read out of it by the writer and allocated again there.  Here the worker
copies the region's numeric arrays into a block of POSIX shared memory (one ``memcpy`` per array) and sends the
block's name and each array's place in it; the writer process maps the block once and writes numpy views of it.
Text arrays (input columns, response formats) are small and go pickled, as before.

Blocks are kept and reused: a partition's region has the same size as the last one's, and a reused block's
pages are already mapped on both sides.  A block goes back to the free list only when every write that reads
it has ended (not when the task awaiting the write is cancelled: the writer process may still be reading it).
Blocks are created by the worker, so its resource tracker unlinks any left when the worker dies; the writer
processes only map them.  Where the shared-memory folder has too little room for a region (a container's
small ``/dev/shm``), the region goes pickled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_ALIGN = 64  # bytes: each array starts on a cache line
_SHM_FOLDER = "/dev/shm"  # where Linux keeps POSIX shared memory (absent elsewhere: no room check)
_ATTACHED_LIMIT = 8  # blocks a writer process keeps mapped


@dataclass(frozen=True)
class SharedRegion:
    """What a writer process needs to rebuild a region: the block's name, each numeric array's ``(shape,
    dtype, offset)`` in it, and the other arrays themselves (pickled)."""

    block: str
    places: dict[str, tuple[tuple[int, ...], str, int]]
    others: dict[str, np.ndarray] = field(default_factory=dict)


class Block:
    """One shared-memory block of a worker and the writes that still read it."""

    def __init__(self, size: int):
        self.memory = shared_memory.SharedMemory(create=True, size=max(size, 1))
        self.holders = 0

    @property
    def size(self) -> int:
        """Bytes the block holds."""
        return self.memory.size

    def free(self) -> None:
        """Unmap and remove the block."""
        self.memory.close()
        self.memory.unlink()


def _shared(array: np.ndarray) -> bool:
    """Whether ``array`` goes through shared memory (plain numbers) rather than pickled (text, objects)."""
    return array.dtype.kind in "biufc"


def _places(arrays: dict[str, np.ndarray]) -> tuple[dict[str, tuple[tuple[int, ...], str, int]], int]:
    """Each numeric array's place in a block and the bytes the block needs."""
    places, end = {}, 0
    for name, array in arrays.items():
        if _shared(array):
            start = -(-end // _ALIGN) * _ALIGN
            places[name] = (array.shape, array.dtype.str, start)
            end = start + array.nbytes
    return places, end


class SharedBlocks:
    """A worker's shared-memory blocks for its writer processes: at most ``keep`` kept free for reuse."""

    def __init__(self, keep: int):
        self.keep = keep
        self.shared = 0  # regions handed over through a block
        self.pickled = 0  # regions handed over pickled (no room in the shared-memory folder)
        self._free: list[Block] = []
        self._lock = threading.Lock()  # a block is given back from the thread that saw its write end
        self._closed = False

    def share(self, arrays: dict[str, np.ndarray]) -> tuple[SharedRegion, Block] | None:
        """``arrays`` copied into a block (held once, for the caller), or ``None`` when there is no room."""
        places, size = _places(arrays)
        block = self._take(size)
        if block is None:
            self.pickled += 1
            return None
        for name, (shape, dtype, offset) in places.items():
            np.copyto(np.ndarray(shape, dtype=dtype, buffer=block.memory.buf, offset=offset), arrays[name])
        others = {name: array for name, array in arrays.items() if name not in places}
        self.shared += 1
        return SharedRegion(block.memory.name, places, others), block

    def _take(self, size: int) -> Block | None:
        """A free block of at least ``size`` bytes (the smallest), else a new one; ``None``: no room for it."""
        with self._lock:
            fits = [b for b in self._free if b.size >= size]
            if fits:
                block = min(fits, key=lambda b: b.size)
                self._free.remove(block)
                block.holders = 1
                return block
        if not _room_for(size):
            return None
        block = Block(size)
        block.holders = 1
        return block

    def hold(self, block: Block) -> None:
        """One more write reads ``block``."""
        with self._lock:
            block.holders += 1

    def drop(self, block: Block) -> None:
        """A write (or the caller) is done with ``block``; the last one gives it back (or removes it)."""
        with self._lock:
            block.holders -= 1
            if block.holders > 0:
                return
            if self._closed or len(self._free) >= self.keep:
                block.free()
            else:
                self._free.append(block)

    def close(self) -> None:
        """Remove the free blocks; blocks still read are removed when their writes end."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for block in free:
            block.free()


def _room_for(size: int) -> bool:
    """Whether the shared-memory folder has room for ``size`` more bytes with half of it left to others."""
    if not os.path.isdir(_SHM_FOLDER):
        return True
    free = shutil.disk_usage(_SHM_FOLDER).free
    if size * 2 > free:
        logger.info("%s has %d bytes free, too few for a %d-byte region: it goes pickled", _SHM_FOLDER, free, size)
        return False
    return True


class Handover:
    """A finished region ready for a writer process: in a shared block of ``blocks`` (held until :meth:`release`,
    or until the hand-over is dropped unwritten, e.g. by a cancelled task), or as its arrays where there was no
    room.  Made in any thread (the one that placed the region), written on the worker's event loop."""

    def __init__(self, blocks: SharedBlocks, arrays: dict[str, np.ndarray]):
        shared = blocks.share(arrays)
        self.arrays = None if shared is not None else arrays
        self.region: SharedRegion | None = shared[0] if shared is not None else None
        self.block: Block | None = shared[1] if shared is not None else None
        self.release: Callable[[], Any] = _nothing if shared is None else weakref.finalize(self, blocks.drop, shared[1])


def _nothing() -> None:
    """A hand-over without a block has nothing to release."""


# --------------------------------------------------------------------------- writer process side

_attached: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()


def _attach(name: str) -> shared_memory.SharedMemory:
    """The block ``name``, mapped once per writer process (the least recently used beyond a few unmapped)."""
    memory = _attached.get(name)
    if memory is not None:
        _attached.move_to_end(name)
        return memory
    if sys.version_info >= (3, 13):  # the worker that created it owns it; only it may remove it
        memory = shared_memory.SharedMemory(name=name, track=False)
    else:
        memory = shared_memory.SharedMemory(name=name)
    _attached[name] = memory
    while len(_attached) > _ATTACHED_LIMIT:
        with contextlib.suppress(BufferError):  # a view still held: the mapping goes with its last view
            _attached.popitem(last=False)[1].close()
    return memory


def arrays_of(region: SharedRegion) -> dict[str, np.ndarray]:
    """The region's arrays: views of its block and the pickled ones."""
    buf = _attach(region.block).buf
    views = {
        name: np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset)
        for name, (shape, dtype, offset) in region.places.items()
    }
    return views | region.others


def write_shared(store: Any, start: int, region: SharedRegion) -> None:
    """Writer process: write the region handed over in shared memory at rows ``start..`` of ``store``."""
    arrays = arrays_of(region)
    try:
        store.write_region(start, arrays)
    finally:
        del arrays  # no view of the block outlives the write
