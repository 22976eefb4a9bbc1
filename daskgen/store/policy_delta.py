"""Delta policy versions between checkpoint folders: made by the publisher, applied where a worker rebuilds.

:func:`make_delta` compares two ``save_pretrained`` folders tensor by tensor (by name, in any file layout) and
encodes what changed (:mod:`daskgen.store.delta_codec`); both must hold the same tensors with the same dtypes
and shapes, else :class:`~daskgen.errors.PolicyDeltaError` names the difference and says to publish the version
in full.  :func:`apply_delta` writes the new version's folder from the base folder: the base's files copied
(config, tokenizer and safetensors files, in the base's layout), then each changed tensor's bytes rewritten in
place.  No framework is loaded: the safetensors headers are parsed and the tensors' bytes memory-mapped.
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from daskgen.engines.fingerprint import tensor_fingerprint
from daskgen.errors import PolicyDeltaError
from daskgen.store.delta_codec import Delta, TensorDelta, decode_tensor, encode_tensor, pack


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor's bytes are in a checkpoint folder: its file, byte range, dtype and shape."""

    file: Path
    begin: int
    end: int
    dtype: str
    shape: tuple[int, ...]


class StaleBase(PolicyDeltaError):
    """The folder a delta was to be made from does not hold the previous version's published tensors."""


def checkpoint_index(folder: str | Path) -> dict[str, TensorSlot]:
    """Every tensor of the safetensors files in ``folder``, by name."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise PolicyDeltaError(
            f"{str(folder)!r} holds no safetensors file: a delta version is made between safetensors checkpoints "
            "(model.save_pretrained(folder))."
        )
    out: dict[str, TensorSlot] = {}
    for file in files:
        with open(file, "rb") as handle:
            try:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            except (struct.error, ValueError) as exc:
                raise PolicyDeltaError(f"{str(file)!r} is not a safetensors file ({exc})") from exc
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = (8 + size + int(x) for x in info["data_offsets"])
                out[name] = TensorSlot(file, begin, end, info["dtype"], tuple(int(n) for n in info["shape"]))
    return out


def _check_same_tensors(before: Mapping[str, TensorSlot], after: Mapping[str, TensorSlot], what: str) -> None:
    gone, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    changed = sorted(
        n for n in set(before) & set(after) if (before[n].dtype, before[n].shape) != (after[n].dtype, after[n].shape)
    )
    if gone or new or changed:
        shown = [f"missing {gone[:3]}" if gone else "", f"added {new[:3]}" if new else ""]
        shown += [
            f"{n}: {before[n].dtype}{list(before[n].shape)} -> {after[n].dtype}{list(after[n].shape)}"
            for n in changed[:3]
        ]
        raise PolicyDeltaError(
            f"{what}: the checkpoints do not hold the same tensors ({'; '.join(s for s in shown if s)}): a delta only "
            "carries new values of the same tensors. Publish this version in full (delta=False)."
        )


def make_delta(
    previous: str | Path,
    new: str | Path,
    base: int,
    version: int,
    expected: Mapping[str, str] | None = None,
) -> bytes:
    """The delta taking the checkpoint folder ``previous`` (version ``base``) to ``new`` (``version``).

    ``expected``: the previous version's published tensor fingerprints; a tensor of ``previous`` that differs
    raises :class:`StaleBase` (the folder changed since it was published).
    """
    before, after = checkpoint_index(previous), checkpoint_index(new)
    _check_same_tensors(before, after, f"version {version} as a delta on version {base}")
    tensors: list[TensorDelta] = []
    with _Mapped() as files:
        for name in sorted(after):
            old, slot = files.view(before[name]), after[name]
            if expected is not None and name in expected:
                found = tensor_fingerprint(slot.dtype, slot.shape, [old])
                if found not in expected[name].split("|"):
                    raise StaleBase(f"{str(previous)!r} no longer holds version {base}'s tensor {name!r}")
            tensors.append(encode_tensor(name, slot.dtype, slot.shape, old, files.view(slot)))
    return pack(base, version, tensors)


def apply_delta(base: str | Path, delta: Delta, out: str | Path) -> None:
    """Write the version ``delta`` makes into the new folder ``out``, from the checkpoint folder ``base``."""
    slots = checkpoint_index(base)
    shapes = {n: TensorSlot(Path(), 0, 0, t.dtype, t.shape) for n, t in delta.tensors.items()}
    _check_same_tensors(slots, shapes, f"delta version {delta.version} on the folder {str(base)!r}")
    target = Path(out)
    target.mkdir(parents=True)
    for file in Path(base).iterdir():
        if file.is_file():
            shutil.copyfile(file, target / file.name)
    with _Mapped(writable=True) as files:
        for name, change in delta.tensors.items():
            if change.kind == "same":
                continue
            slot = slots[name]
            view = files.view(TensorSlot(target / slot.file.name, slot.begin, slot.end, slot.dtype, slot.shape))
            view[:] = memoryview(decode_tensor(change, view).tobytes())


class _Mapped:
    """Memory maps of the files tensors are read from (or written to), opened once each, closed together."""

    def __init__(self, writable: bool = False) -> None:
        self.writable, self.maps, self.views = writable, {}, []  # type: ignore[var-annotated]

    def __enter__(self) -> _Mapped:
        return self

    def view(self, slot: TensorSlot) -> memoryview:
        if slot.file not in self.maps:
            with open(slot.file, "r+b" if self.writable else "rb") as handle:
                access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
                self.maps[slot.file] = mmap.mmap(handle.fileno(), 0, access=access)
        view = memoryview(self.maps[slot.file])[slot.begin : slot.end]
        self.views.append(view)
        return view

    def __exit__(self, *exc: object) -> None:
        for view in self.views:
            view.release()
        for mapped in self.maps.values():
            if self.writable:
                mapped.flush()
            mapped.close()
