"""Where an inner chunk of a packed (sharded) array lives: its shard's key and the shard's index.

A packed store (:mod:`daskgen.store.tools.pack`) keeps each array's partition-sized chunks as *inner chunks* of
few shard files (Zarr v3 sharding).  A shard ends with an index: per inner chunk its byte offset and
length, both ``2**64 - 1`` for an inner chunk that is not there, which reads back as fill values without an
error, as a missing chunk file does in an unpacked store.  This module reads that index (only the shard's
last bytes) so that ``verify`` can tell a missing inner chunk, and hands out an inner chunk's encoded bytes
as stored (``unpack`` copies a damaged one as it is, so that the unpacked store still shows the damage).

Only the index layout daskgen writes is read: at the shard's end, little-endian ``uint64`` pairs,
optionally followed by a CRC32C (zarr's default); anything else raises :class:`~daskgen.errors.StoreError`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.errors import StoreError
from daskgen.store.location import StoreLocation

#: The index entry of an inner chunk that is not in its shard (offset and length).
ABSENT = 2**64 - 1


def sharding(arr: Any) -> Any | None:
    """The sharding codec of the Zarr array ``arr``, or ``None`` when it is not sharded."""
    from zarr.codecs import ShardingCodec

    codecs = arr.metadata.codecs
    return codecs[0] if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec) else None


def shard_of(arr: Any, index: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grid index of the shard holding inner chunk ``index`` of the sharded ``arr``, and the inner
    chunk's index inside that shard."""
    per_shard = _per_shard(arr)
    return tuple(i // n for i, n in zip(index, per_shard, strict=True)), tuple(
        i % n for i, n in zip(index, per_shard, strict=True)
    )


def shard_key(arr: Any, name: str, shard: tuple[int, ...]) -> str:
    """The key (path in the store) of shard ``shard`` of array ``name``."""
    return f"{name}/{arr.metadata.encode_chunk_key(shard)}"


def read_index(location: StoreLocation, arr: Any, name: str, shard: tuple[int, ...]) -> np.ndarray | None:
    """The index of one shard of ``arr`` (shape: inner chunks per shard, then offset and length), or ``None``
    when the shard file itself is not there."""
    codec, per_shard = _checked(arr, name), _per_shard(arr)
    checksum = 4 if len(codec.index_codecs) == 2 else 0
    size = 16 * int(np.prod(per_shard)) + checksum
    raw = location.read_tail(shard_key(arr, name, shard), size)
    if raw is None:
        return None
    if len(raw) < size:
        raise StoreError(f"shard {shard_key(arr, name, shard)!r} is shorter ({len(raw)} bytes) than its index")
    return np.frombuffer(raw[: size - checksum], dtype="<u8").reshape(*per_shard, 2)


def inner_present(index: np.ndarray, inner: tuple[int, ...]) -> bool:
    """True when inner chunk ``inner`` (index inside its shard) has an entry in the shard's ``index``."""
    return not (index[inner] == ABSENT).all()


def inner_chunk_bytes(location: StoreLocation, arr: Any, name: str, index: tuple[int, ...]) -> bytes | None:
    """The encoded bytes of inner chunk ``index`` of ``arr`` as stored (``None`` when it is not there)."""
    shard, inner = shard_of(arr, index)
    table = read_index(location, arr, name, shard)
    if table is None or not inner_present(table, inner):
        return None
    offset, length = (int(v) for v in table[inner])
    data = location.read_bytes(shard_key(arr, name, shard))
    return None if data is None else data[offset : offset + length]


def _per_shard(arr: Any) -> tuple[int, ...]:
    return tuple(s // c for s, c in zip(arr.shards, arr.chunks, strict=True))


def _checked(arr: Any, name: str) -> Any:
    """The sharding codec of ``arr``, when its index is laid out as this module reads it."""
    from zarr.codecs import BytesCodec, Crc32cCodec

    codec = sharding(arr)
    if codec is not None:
        kinds = [type(c) for c in codec.index_codecs]
        endian = getattr(getattr(codec.index_codecs[0], "endian", None), "value", "little")
        at_end = codec.index_location.value == "end"
        if at_end and endian == "little" and kinds in ([BytesCodec], [BytesCodec, Crc32cCodec]):
            return codec
    raise StoreError(
        f"array {name!r} is not sharded as daskgen packs arrays (index at the shard's end, little-endian "
        f"offsets, optional CRC32C); unpack it with the tool that packed it."
    )
