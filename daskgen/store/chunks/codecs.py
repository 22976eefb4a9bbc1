"""The codec chain of every array daskgen writes: Zstandard, then a CRC32C checksum of each chunk.

One rule, used by new stores and by ``daskgen pack``/``unpack`` (which add the checksum to arrays of
stores made before it existed): a chunk whose bytes changed on disk (a flipped bit, a torn or truncated
write) fails its checksum when read, instead of decoding into silently wrong values.  In a packed
(sharded) store the checksum sits on every inner chunk, and the shard index carries its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Zstandard level of every chunk (fast; token ids compress several-fold).
ZSTD_LEVEL = 3


def compressors() -> list[Any]:
    """The bytes-to-bytes codecs of every array daskgen creates: Zstandard, then CRC32C."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=ZSTD_LEVEL), Crc32cCodec()]


def with_checksum(codecs: Iterable[Any]) -> list[Any]:
    """``codecs`` with a CRC32C checksum last, added when they have none."""
    from zarr.codecs import Crc32cCodec

    chain = list(codecs)
    return chain if any(is_checksum(c) for c in chain) else [*chain, Crc32cCodec()]


def is_checksum(codec: Any) -> bool:
    """True for a codec that checksums each chunk (CRC32C)."""
    from zarr.codecs import Crc32cCodec

    return isinstance(codec, Crc32cCodec)


def chunks_checksummed(codecs: Iterable[Any]) -> bool:
    """True when an array's codec chain checksums its chunks (inside a sharding codec: its inner chunks)."""
    from zarr.codecs import ShardingCodec

    for codec in codecs:
        if isinstance(codec, ShardingCodec):
            return chunks_checksummed(codec.codecs)
        if is_checksum(codec):
            return True
    return False
