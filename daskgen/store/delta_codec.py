"""The encoding of a delta policy version: per tensor, what changed since the version it applies to.

Values are compared and stored as their raw bits (bfloat16 as 16-bit words, float32 as 32-bit words, ...), so a
rebuild is exact in every dtype, and a value counts as changed when any bit of it changed.  Each tensor is stored
in one of three kinds:

* ``same``: no value changed; nothing is stored;
* ``sparse``: the flat indices of the changed values, as gaps from the previous changed index (the first from
  0; ``uint32``, or ``uint64`` when a gap does not fit), followed by each changed value's bits XOR its old bits;
* ``dense``: the whole tensor's bits XOR its old bits (0 where a value did not change).

``sparse`` is chosen when its raw size (a gap and a value per changed value) is below the ``dense`` one (a value
per value): for bfloat16 with ``uint32`` gaps, when fewer than a third of the values changed.  The XOR of a value
nudged by a small optimizer step keeps its sign, exponent and high mantissa bits at 0, which compresses well.
Each tensor's bytes are compressed with Zstandard (:data:`ZSTD_LEVEL`).  A delta is one blob (:func:`pack`):
``DGDELTA1``, the length of a JSON header (8 bytes, little-endian), the header (``{"base", "version",
"tensors": [{"name", "dtype", "shape", "kind", "changed", "gap", "offset", "length"}, ...]}``) and the
compressed tensors one after the other.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from daskgen.errors import PolicyDeltaError

#: The first bytes of every delta.
MAGIC = b"DGDELTA1"
#: Zstandard level of each tensor's bytes.
ZSTD_LEVEL = 3
#: Bytes per element of each safetensors dtype code (others are compared byte by byte).
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_WORDS = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's change: its name, dtype and shape (as in both versions), the kind of encoding, how many
    values changed, the width of the sparse gaps (``"u4"``/``"u8"``; ``""`` otherwise) and the compressed bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "same", "sparse" or "dense"
    changed: int
    gap: str
    payload: bytes


def _words(raw: Any, dtype: str) -> np.ndarray:
    """The raw bits of a tensor's bytes as unsigned words of its element size."""
    return np.frombuffer(raw, dtype=_WORDS[ITEMSIZE.get(dtype, 1)])


def _zstd() -> Any:
    from numcodecs.zstd import Zstd

    return Zstd(level=ZSTD_LEVEL)


def encode_tensor(name: str, dtype: str, shape: tuple[int, ...], old: Any, new: Any) -> TensorDelta:
    """The delta taking the bytes ``old`` of tensor ``name`` to the bytes ``new`` (same dtype and shape)."""
    before, after = _words(old, dtype), _words(new, dtype)
    if before.shape != after.shape:
        raise PolicyDeltaError(f"tensor {name!r}: {before.size} values before, {after.size} after, for one shape")
    xor = np.bitwise_xor(before, after)
    where = np.flatnonzero(xor)
    if where.size == 0:
        return TensorDelta(name, dtype, shape, "same", 0, "", b"")
    gaps = np.diff(where, prepend=0)
    gap = "u4" if int(gaps.max()) < 2**32 else "u8"
    sparse_size = where.size * (int(gap[1]) + xor.itemsize)
    if sparse_size < xor.nbytes:
        raw = gaps.astype("<" + gap).tobytes() + xor[where].tobytes()
        return TensorDelta(name, dtype, shape, "sparse", int(where.size), gap, bytes(_zstd().encode(raw)))
    return TensorDelta(name, dtype, shape, "dense", int(where.size), "", bytes(_zstd().encode(xor.tobytes())))


def decode_tensor(delta: TensorDelta, old: Any) -> np.ndarray:
    """The new bytes (as unsigned words) of the tensor whose old bytes are ``old``."""
    before = _words(old, delta.dtype)
    if delta.kind == "same":
        return before.copy()
    raw = bytes(_zstd().decode(delta.payload))
    if delta.kind == "dense":
        xor = np.frombuffer(raw, dtype=before.dtype)
        if xor.shape != before.shape:
            raise PolicyDeltaError(f"tensor {delta.name!r}: the delta holds {xor.size} values, the base {before.size}")
        return np.bitwise_xor(before, xor)
    if delta.kind != "sparse":
        raise PolicyDeltaError(f"tensor {delta.name!r}: unknown delta kind {delta.kind!r}")
    width = int(delta.gap[1]) * delta.changed
    where = np.cumsum(np.frombuffer(raw[:width], dtype="<" + delta.gap), dtype=np.uint64).astype(np.int64)
    xor = np.frombuffer(raw[width:], dtype=before.dtype)
    if where.size != delta.changed or xor.size != delta.changed or (where.size and where[-1] >= before.size):
        raise PolicyDeltaError(f"tensor {delta.name!r}: the delta's changed values do not fit the base tensor")
    out = before.copy()
    out[where] ^= xor
    return out


def pack(base: int, version: int, tensors: list[TensorDelta]) -> bytes:
    """One blob holding the deltas ``tensors`` taking version ``base`` to ``version``."""
    entries, offset = [], 0
    for t in tensors:
        entry = {k: v for k, v in asdict(t).items() if k != "payload"}
        entries.append({**entry, "shape": list(t.shape), "offset": offset, "length": len(t.payload)})
        offset += len(t.payload)
    header = json.dumps({"base": base, "version": version, "tensors": entries}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, *(t.payload for t in tensors)])


@dataclass(frozen=True)
class Delta:
    """An unpacked delta: the version it applies to, the version it makes, and each tensor's change by name."""

    base: int
    version: int
    tensors: dict[str, TensorDelta]


def unpack(raw: bytes, what: str = "the delta") -> Delta:
    """The delta in the blob ``raw`` (``what`` names it in errors)."""
    if raw[: len(MAGIC)] != MAGIC:
        raise PolicyDeltaError(f"{what} is not a daskgen policy delta (it does not start with {MAGIC!r})")
    try:
        (size,) = struct.unpack("<Q", raw[len(MAGIC) : len(MAGIC) + 8])
        start = len(MAGIC) + 8 + size
        header = json.loads(raw[len(MAGIC) + 8 : start])
        tensors = dict(_entries(header["tensors"], raw, start))
        return Delta(int(header["base"]), int(header["version"]), tensors)
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise PolicyDeltaError(f"{what} has a broken header ({type(exc).__name__}: {exc})") from exc


def _entries(entries: list[dict[str, Any]], raw: bytes, start: int) -> Iterator[tuple[str, TensorDelta]]:
    for e in entries:
        begin = start + int(e["offset"])
        end = begin + int(e["length"])
        if end > len(raw):
            raise ValueError(f"tensor {e['name']!r} ends at byte {end} of a {len(raw)}-byte delta")
        shape = tuple(int(n) for n in e["shape"])
        yield (
            e["name"],
            TensorDelta(e["name"], e["dtype"], shape, e["kind"], int(e["changed"]), e["gap"], raw[begin:end]),
        )
