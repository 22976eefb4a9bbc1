"""Files an engine's processes leave in the machine's shared folders, removed when the engine shuts down.

The engines' processes are killed at shutdown (or end without their own clean-up), so files they made in folders
every process of the machine shares would outlive them, one set per engine start:

* **sglang** (in process, and the managed server): a load-report file per engine in the shared-memory folder,
  ``/dev/shm/sglang_loads_<instance>_<digest>.shm``, which sglang's scheduler keeps open while it runs;
* **vLLM**: the rendezvous file of its ``torch.distributed`` file store (``vllm_dist_<uuid>``) and its ZeroMQ
  sockets (``<uuid>``), made in the temporary folder by the processes it starts.

Only files of the engine being stopped are removed, never another process's: sglang's are the ones its own
processes hold open (:func:`held_files`, read before they are stopped) or the one named after its instance; vLLM's
processes start with a temporary folder of their own (:func:`temp_folder_for_children`), removed with everything
in it once they are gone.  Linux only (``/proc``); elsewhere nothing is found and nothing removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["SGLANG_LOADS", "SHARED_MEMORY", "held_files", "remove_files", "remove_folder", "temp_folder_for_children"]

logger = logging.getLogger(__name__)

#: The shared-memory folder (a tmpfs on Linux).
SHARED_MEMORY = Path("/dev/shm")
#: The name prefix of sglang's load-report files in :data:`SHARED_MEMORY`.
SGLANG_LOADS = "sglang_loads_"


def held_files(pids: Iterable[int], folder: Path, prefix: str) -> set[Path]:
    """Files in ``folder`` whose names start with ``prefix`` that the processes ``pids`` hold open (their
    ``/proc/<pid>/fd`` links); processes that are gone or not readable are skipped."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = Path(os.readlink(fd.path))
                    if target.parent == folder and target.name.startswith(prefix):
                        found.add(target)
    return found


def remove_files(paths: Iterable[Path], owner: str) -> None:
    """Remove ``paths`` (left by ``owner``, named in the log); missing ones are fine, a failure is logged."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("daskgen: could not remove %s left by %s: %s", path, owner, exc)
        else:
            logger.debug("daskgen: removed %s left by %s", path, owner)


def remove_folder(folder: Path | None, owner: str) -> None:
    """Remove ``folder`` and everything in it (the temporary folder of ``owner``'s processes)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            logger.warning("daskgen: could not remove %s, the temporary folder of %s", folder, owner)


@contextlib.contextmanager
def temp_folder_for_children(prefix: str) -> Iterator[Path]:
    """A new temporary folder that processes started inside the block take as theirs; the folder (its owner
    removes it with :func:`remove_folder` once those processes are gone).

    Inside the block ``TMPDIR`` (read by a spawned process) and :data:`tempfile.tempdir` (inherited by a forked
    one) name the folder; both are restored when the block ends.  Temporary files this process makes meanwhile go
    there too, so keep the block to the start of the processes.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
