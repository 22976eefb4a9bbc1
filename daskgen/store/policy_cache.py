"""The node-local cache where delta policy versions are rebuilt into full checkpoint folders.

A worker about to load a delta version asks :func:`checkpoint_for` for a folder its engine can load.  A full
version is its published folder, as it is.  A delta version is rebuilt under ``daskgen.policy.cache-dir`` (a
folder per store; default: ``daskgen-policy-cache`` in the system's temporary folder): from the newest version
before it that is either full or already rebuilt in this cache, plus the deltas after it, read from the store's
policy area (``daskgen.policy.deltas/``).  The rebuilt folder's fingerprint (:mod:`daskgen.store.fingerprint`)
must equal the version's published digest, else the rebuild is deleted and
:class:`~daskgen.errors.PolicyDeltaError` names the tensors that differ; only a checked rebuild is renamed
into place (``v<version>-<digest>``), so a folder in the cache always holds its version.  Rebuilds in one cache
take a file lock (``fcntl.flock`` on ``.lock``): the workers of a node sharing the cache read the deltas and
rebuild once, the others wait and load the same folder.  Once a version is rebuilt, rebuilds more than
``daskgen.policy.cache-keep`` versions older are deleted.

Each :class:`LocalCheckpoint` counts the bytes its worker reads from shared storage for the version
(``shared_bytes``, recorded with the worker's policy state): a full version's safetensors files, which the engine
loads from the published folder; for a rebuild, the deltas read from the store plus every file of the published
full version it starts from (none when it starts from a rebuild in this cache); 0 when another worker of the node
rebuilt it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from daskgen import tunables
from daskgen.errors import PolicyDeltaError
from daskgen.store.delta_codec import unpack
from daskgen.store.fingerprint import checkpoint_fingerprint, mismatched
from daskgen.store.location import StoreLocation
from daskgen.store.policy_delta import apply_delta
from daskgen.store.policy_versions import PolicyVersion, read_versions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalCheckpoint:
    """A folder holding a version's full weights; ``rebuilt``: this call rebuilt it, reading ``delta_bytes``
    bytes of deltas from the store (0 when the folder was published in full or found in the cache);
    ``shared_bytes``: what the worker reads from shared storage to load it (``None`` for a URL checkpoint, which
    daskgen does not read)."""

    path: str
    rebuilt: bool = False
    delta_bytes: int = 0
    shared_bytes: int | None = 0


def cache_folder(location: StoreLocation) -> Path:
    """This node's cache folder for the store ``location`` (``daskgen.policy.cache-dir``, one folder per store)."""
    root = tunables.get("policy.cache-dir") or os.path.join(tempfile.gettempdir(), "daskgen-policy-cache")
    key = hashlib.blake2b(location.url.encode(), digest_size=8).hexdigest()
    return Path(root).expanduser() / f"{location.name}-{key}"


def checkpoint_for(location: StoreLocation, entry: PolicyVersion) -> LocalCheckpoint:
    """A folder holding ``entry``'s full weights: its published folder, or its checked rebuild in this node's
    cache (rebuilt now when absent)."""
    if entry.delta is None:
        return LocalCheckpoint(entry.path, shared_bytes=weight_bytes(entry.path))
    folder = cache_folder(location)
    if (folder / _name(entry)).is_dir():
        return LocalCheckpoint(str(folder / _name(entry)))
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        if (folder / _name(entry)).is_dir():  # another worker of the node rebuilt it while this one waited
            return LocalCheckpoint(str(folder / _name(entry)))
        return _rebuild(location, entry, folder)


def weight_bytes(path: str) -> int | None:
    """The bytes of the safetensors files in the checkpoint folder ``path`` (``None`` when it is no folder)."""
    folder = Path(path)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) if folder.is_dir() else None


def _folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def _name(entry: PolicyVersion) -> str:
    return f"v{entry.version}-{(entry.digest or 'none')[:16]}"


def _chain(location: StoreLocation, entry: PolicyVersion, folder: Path) -> tuple[str, list[PolicyVersion]]:
    """The folder to start from (a full version, or one rebuilt in ``folder``) and the deltas to apply to it."""
    versions = {v.version: v for v in read_versions(location)}
    deltas, at = [], entry
    while at.delta is not None:
        deltas.append(at)
        base = versions.get(at.base if at.base is not None else -1)
        if base is None:
            raise PolicyDeltaError(
                f"delta version {at.version} applies to version {at.base}, which the policy record of "
                f"{location.url!r} does not hold: publish version {entry.version} or a later one in full."
            )
        if base.delta is None or (folder / _name(base)).is_dir():
            start = base.path if base.delta is None else str(folder / _name(base))
            return start, deltas[::-1]
        at = base
    raise AssertionError("unreachable: a full version has no delta")


def _rebuild(location: StoreLocation, entry: PolicyVersion, folder: Path) -> LocalCheckpoint:
    start, deltas = _chain(location, entry, folder)
    logger.info("daskgen: rebuilding policy version %d from %s and %d deltas", entry.version, start, len(deltas))
    current, made, read = start, [], 0
    shared = 0 if Path(start).parent == folder else _folder_bytes(start)  # a published full version's files
    try:
        for step in deltas:
            raw = location.read_bytes(step.delta or "")
            if raw is None:
                raise PolicyDeltaError(
                    f"the delta of version {step.version} ({location.url}/{step.delta}) is missing: publish "
                    f"version {entry.version} or a later one in full."
                )
            read += len(raw)
            delta = unpack(raw, f"{location.url}/{step.delta}")
            if (delta.base, delta.version) != (step.base, step.version):
                raise PolicyDeltaError(
                    f"{location.url}/{step.delta} takes version {delta.base} to {delta.version}, the record says "
                    f"{step.base} to {step.version}"
                )
            made.append(Path(tempfile.mkdtemp(prefix=f".build-v{step.version}-", dir=folder)) / "weights")
            apply_delta(current, delta, made[-1])
            current = str(made[-1])
        _check(made[-1], entry)
        target = folder / _name(entry)
        os.rename(made[-1], target)
    finally:
        for path in made:
            shutil.rmtree(path.parent, ignore_errors=True)
    _evict(folder, entry.version)
    return LocalCheckpoint(str(target), True, read, shared + read)


def _check(rebuilt: Path, entry: PolicyVersion) -> None:
    """Raise :class:`~daskgen.errors.PolicyDeltaError` unless ``rebuilt`` has ``entry``'s published digest."""
    found = checkpoint_fingerprint(rebuilt)
    if found is not None and found.digest == entry.digest:
        return
    rebuilt_tensors = {name: f.split("|")[0] for name, f in (found.tensors if found else {}).items()}
    wrong, compared = mismatched(entry.tensors or {}, rebuilt_tensors)  # each in its checkpoint dtype
    shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
    raise PolicyDeltaError(
        f"the weights rebuilt for delta version {entry.version} differ from its published fingerprint in "
        f"{len(wrong)} of {compared} tensors ({shown}): a delta or its base is corrupt; refused before loading"
    )


def _evict(folder: Path, newest: int) -> None:
    """Delete the rebuilds more than ``daskgen.policy.cache-keep`` versions older than ``newest``."""
    keep = int(tunables.get("policy.cache-keep"))
    for path in folder.glob("v*-*"):
        with contextlib.suppress(ValueError):
            if int(path.name[1:].split("-")[0]) < newest - keep:
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / ".lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
