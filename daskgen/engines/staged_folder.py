"""A policy version's folder copied into host memory while the engine generates, for engines that load folders.

An engine that loads a checkpoint only from a folder (vLLM's ``reload_weights``) reads its files in the refresh
pause.  Staged here, the files are read from where the version lies (shared storage, or the node's delta cache)
while the engine still generates, into a fresh folder on the shared-memory file system
(``daskgen.policy.stage-dir``, ``/dev/shm`` by default); the pause then reads memory, never the shared storage.
The copy is removed once loaded.  Each worker copies the version for its own engine, so the workers of a node hold
one copy each while they refresh; a copy is made only where it fits: when the file system's free space is less
than the folder's size and ``daskgen.policy.stage-reserve`` of it, the folder is loaded from where it lies, as it
would be without staging.
A worker killed between staging and loading leaves its copy: its folder name holds the worker's process id, and
the next staging on the node removes the copies of processes that are gone (:func:`remove_orphans`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

from daskgen import tunables

__all__ = ["PREFIX", "StagedFolder", "remove_orphans", "stage_folder"]

logger = logging.getLogger(__name__)

#: The name prefix of staged copies (followed by the staging process's id).
PREFIX = "daskgen-stage-"


@dataclass(frozen=True)
class StagedFolder:
    """A version folder (``source``) copied into host memory (``path``)."""

    source: str
    path: str

    def remove(self) -> None:
        """Remove the copy."""
        shutil.rmtree(self.path, ignore_errors=True)


def stage_folder(source: str) -> StagedFolder | None:
    """Copy the files of the folder ``source`` into a new folder under ``daskgen.policy.stage-dir`` (blocking);
    ``None`` when staging is off (the setting is empty), the folder is not there, or the copy would not fit."""
    root = tunables.get("policy.stage-dir")
    if not root or not Path(root).is_dir() or not Path(source).is_dir():
        return None
    files = [f for f in Path(source).iterdir() if f.is_file()]
    if not files:
        return None
    remove_orphans(Path(root))
    size = sum(f.stat().st_size for f in files)
    reserve = float(tunables.get("policy.stage-reserve"))
    if size * (1 + reserve) > shutil.disk_usage(root).free:
        logger.warning("daskgen: %s (%d bytes) does not fit in %s: it is loaded from where it lies", source, size, root)
        return None
    target = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
    try:
        for f in files:
            shutil.copyfile(f, os.path.join(target, f.name))
    except OSError as exc:  # the file system filled up meanwhile, or the folder changed
        shutil.rmtree(target, ignore_errors=True)
        logger.warning("daskgen: staging %s in %s failed (%s): it is loaded from where it lies", source, root, exc)
        return None
    return StagedFolder(source, target)


def remove_orphans(root: Path) -> list[Path]:
    """Remove the staged copies under ``root`` whose staging process is gone; the folders removed."""
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        pid = folder.name[len(PREFIX) :].partition("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
