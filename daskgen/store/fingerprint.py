"""Fingerprints of policy weights: one hash per tensor, one digest per version, one integer per sample.

A tensor's fingerprint is ``"<dtype>:<hash>"``: its safetensors dtype code (``F32``, ``BF16``, ...) and the
BLAKE2b hash (16 bytes, hex) of that code, its shape and its raw bytes in row-major order
(:func:`daskgen.engines.fingerprint.tensor_fingerprint`).  A float32 tensor's entry also holds the fingerprints of
its values cast to bfloat16 and float16 (round to nearest even, as torch casts), ``"F32:<h>|BF16:<h>|F16:<h>"``,
so that an engine serving a float32 checkpoint in fewer bits is checked against what it should hold.  ``publish_policy``
takes it of every tensor of the checkpoint, from the safetensors files (:func:`checkpoint_fingerprint`: the
header is parsed and each tensor's bytes hashed where they lie, no framework needed); each worker takes it of the
tensors its engine holds (:meth:`daskgen.engines.base.Engine.loaded_fingerprint`, through
:func:`daskgen.engines.fingerprint.fingerprint_tensors`), so the two agree only when the engine holds the same
values in the same dtype.  A version's digest is the BLAKE2b hash of its tensors' names and fingerprints in name
order (:func:`version_digest`); each sample stores its first 8 bytes as a signed integer (:func:`digest_number`),
0 meaning "no checked version".
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daskgen.engines.fingerprint import DIGEST_BYTES, tensor_fingerprint
from daskgen.errors import PolicyError

#: The per-sample value of a sample without a checked version (version 0, no model token, an unchecked load).
NO_FINGERPRINT = 0
#: Bytes hashed per update (keeps memory flat on large tensors; a multiple of every element size).
_BLOCK = 64 << 20
#: The narrower float dtypes an engine may serve a float32 checkpoint in, each with its cast of float32 bytes.
_NARROWER = ("BF16", "F16")


@dataclass(frozen=True)
class Fingerprint:
    """A version's fingerprint: every tensor's hash by its checkpoint name, and the digest derived from them."""

    digest: str
    tensors: dict[str, str]


def version_digest(tensors: Mapping[str, str]) -> str:
    """The digest of a version from its tensors' hashes (names in sorted order, so file order does not matter)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name in sorted(tensors):
        h.update(f"{name}\0{tensors[name]}\n".encode())
    return h.hexdigest()


def digest_number(digest: str | None) -> int:
    """The per-sample integer of a version digest: its first 8 bytes, big-endian, signed (0 for ``None``)."""
    if not digest:
        return NO_FINGERPRINT
    return int.from_bytes(bytes.fromhex(digest)[:8], "big", signed=True)


def checkpoint_fingerprint(folder: str | Path) -> Fingerprint | None:
    """The fingerprint of every tensor in the safetensors files of the checkpoint folder ``folder`` (``None``
    when it holds none: nothing to fingerprint).

    Raises :class:`~daskgen.errors.PolicyError` when a ``*.safetensors`` file is not safetensors.
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, str] = {}
    for file in files:
        tensors.update(_file_fingerprints(file))
    return Fingerprint(version_digest(tensors), tensors)


def _file_fingerprints(file: Path) -> dict[str, str]:
    """Each tensor's hash in one safetensors file (memory-mapped: the bytes are hashed where they lie)."""
    with open(file, "rb") as handle:
        head = handle.read(8)
        try:
            (size,) = struct.unpack("<Q", head)
            header = json.loads(handle.read(size))
        except (struct.error, ValueError) as exc:
            raise PolicyError(
                f"{str(file)!r} is not a safetensors file ({type(exc).__name__}: {exc}); save the weights with "
                "model.save_pretrained(folder)."
            ) from exc
        base = 8 + size
        out: dict[str, str] = {}
        if all(name == "__metadata__" for name in header):
            return out
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for name, info in header.items():
                    if name == "__metadata__":
                        continue
                    begin, end = (base + int(x) for x in info["data_offsets"])
                    out[name] = _fingerprints(view, begin, end, info["dtype"], info["shape"])
            finally:
                view.release()
    return out


def _fingerprints(view: memoryview, begin: int, end: int, dtype: str, shape: list[int]) -> str:
    """The fingerprint of the tensor in ``view[begin:end]``; of a float32 tensor also those of its narrower casts."""

    def pieces() -> Iterator[memoryview]:
        return (view[at : min(at + _BLOCK, end)] for at in range(begin, end, _BLOCK))

    found = [tensor_fingerprint(dtype, shape, pieces())]
    if dtype == "F32":
        for code in _NARROWER:
            found.append(tensor_fingerprint(code, shape, (_cast(piece, code) for piece in pieces())))
    return "|".join(found)


def _cast(piece: memoryview, code: str) -> bytes:
    """Little-endian float32 bytes cast to bfloat16 or float16 bytes, rounding to nearest even as torch does."""
    values = np.frombuffer(piece, dtype="<f4")
    if code == "F16":
        return values.astype("<f2").tobytes()
    bits = values.view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()  # NaN bits differ between kernels


def dtype_of(fingerprint: str) -> str:
    """The safetensors dtype code a tensor's fingerprint was taken in (``"F32"`` of ``"F32:<hash>"``)."""
    return fingerprint.partition(":")[0]


def mismatched(published: Mapping[str, str], loaded: Mapping[str, str]) -> tuple[list[str], int]:
    """The published tensors whose loaded hash differs, and how many were compared (names the engine holds as
    they were published; the others, e.g. fused into another tensor, are not compared)."""
    compared = [name for name in published if name in loaded]
    return sorted(name for name in compared if loaded[name] not in published[name].split("|")), len(compared)
