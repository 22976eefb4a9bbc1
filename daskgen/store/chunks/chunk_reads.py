"""Reading rows of a local store's plain arrays chunk file by chunk file, without Zarr's per-chunk machinery.

A batch of a follower reads a few chunks of each of a dozen arrays; through Zarr each chunk costs several
asyncio tasks and thread hand-overs, far more CPU than its bytes (a chunk of 64 rows decodes in tens of µs).
For an array daskgen wrote unpacked in a local folder (a regular grid chunked along the rows only, codecs
``bytes`` (little-endian), ``zstd`` and optionally ``crc32c``: :mod:`daskgen.store.chunks.codecs`) the chunk files are
read and decoded here in one pass, straight into the result where a chunk lies wholly inside the span.  A
missing chunk file reads as the fill value, as in Zarr; a chunk whose checksum fails raises
:class:`~daskgen.errors.StoreError` naming it.  Any other array (sharded, other codecs, object storage) is read
through Zarr (:meth:`~daskgen.store.generation_store.GenerationStore.read_spans` decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.errors import StoreError


@dataclass(frozen=True)
class PlainArray:
    """What reading an array's chunk files takes: where they are, how they are named and decoded."""

    folder: Path
    metadata: Any
    dtype: np.dtype
    rows_per_chunk: int
    chunk_shape: tuple[int, ...]
    fill_value: Any
    checksummed: bool

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of the array (``hi`` within its length)."""
        from numcodecs.zstd import Zstd

        zstd, per = Zstd(), self.rows_per_chunk
        out = np.empty((hi - lo, *self.chunk_shape[1:]), dtype=self.dtype)
        for chunk in range(lo // per, -(-hi // per)):
            start, stop = max(lo, chunk * per), min(hi, (chunk + 1) * per)
            target = out[start - lo : stop - lo]
            whole = start == chunk * per and stop - start == per
            decoded = self._decode(chunk, zstd, target if whole else None)
            if decoded is None:
                target[...] = self.fill_value
            elif not whole:
                target[...] = decoded[start - chunk * per : stop - chunk * per]
        return out

    def _decode(self, chunk: int, zstd: Any, into: np.ndarray | None) -> np.ndarray | None:
        """Chunk ``chunk`` decoded (into ``into`` when given); ``None`` when its file is absent."""
        key = self.metadata.encode_chunk_key((chunk, *[0] * (len(self.chunk_shape) - 1)))
        try:
            with open(f"{self.folder}/{key}", "rb") as fh:
                data = fh.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        view = np.frombuffer(data, dtype=np.uint8)
        if self.checksummed:
            view = _checked(view, self.folder / key)
        out = into if into is not None else np.empty(self.chunk_shape, dtype=self.dtype)
        zstd.decode(view, out=out)
        return out


def _checked(data: np.ndarray, path: Path) -> np.ndarray:
    """``data`` without its trailing CRC32C, which must match."""
    import google_crc32c

    body = data[:-4]
    if np.uint32(google_crc32c.value(body)).tobytes() != bytes(data[-4:]):
        raise StoreError(
            f"chunk file {path} fails its CRC32C checksum: its bytes changed on disk. "
            "`daskgen verify STORE` lists the damaged chunks; `daskgen verify STORE --repair` and a rerun "
            "regenerate them."
        )
    return body


def plain_array(folder: Path, arr: Any) -> PlainArray | None:
    """How to read the Zarr array ``arr`` (stored under ``folder``) chunk file by chunk file, or ``None`` when it
    is not a plain array (see the module docstring) and must be read through Zarr."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
    from zarr.core.chunk_grids import RegularChunkGrid

    meta = arr.metadata
    if getattr(meta, "zarr_format", None) != 3 or not isinstance(meta.chunk_grid, RegularChunkGrid):
        return None
    codecs, chunks = list(meta.codecs), tuple(meta.chunk_grid.chunk_shape)
    checksummed = bool(codecs) and isinstance(codecs[-1], Crc32cCodec)
    inner = codecs[:-1] if checksummed else codecs
    if [type(c) for c in inner] != [BytesCodec, ZstdCodec] or chunks[1:] != tuple(arr.shape[1:]):
        return None
    endian = getattr(inner[0].endian, "value", inner[0].endian)
    dtype = np.dtype(arr.dtype)
    if dtype.kind not in "biuf" or (dtype.itemsize > 1 and endian != "little"):
        return None
    return PlainArray(folder, meta, dtype.newbyteorder("<"), chunks[0], chunks, arr.fill_value, checksummed)
