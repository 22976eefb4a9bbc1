"""Files an engine's processes leave in the machine's shared folders, removed when the engine shuts down.

The engines' processes are killed at shutdown (or end without their own clean-up), so files they made in folders
every process of the machine shares would outlive them, one set per engine start:

* **sglang** (in process, and the managed server): a load-report file per engine in the shared-memory folder,
  ``/dev/shm/sglang_loads_<instance>_<digest>.shm``, which sglang's scheduler keeps open while it runs;
* **vLLM**: the rendezvous file of its ``torch.distributed`` file store (``vllm_dist_<uuid>``) and its ZeroMQ
  sockets (``<uuid>``), made in the temporary folder by the processes it starts.

Only files of the engine being stopped are removed, never another process's: sglang's are the ones its own
processes hold open (:func:`held_files`, read and unlinked before they are stopped: a process keeps what it holds
open until it exits, and a worker killed while its engine stops then leaves nothing) or the one named after its
instance; vLLM's
processes start with a temporary folder of their own (:func:`temp_folder_for_children`), removed with everything
in it once they are gone, or, when the worker is killed first (a nanny kills a worker that takes more than a
few seconds to close), by a small watcher process once the worker has exited (:func:`remove_when_gone`).  Linux
only (``/proc``); elsewhere nothing is found and nothing removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = [
    "SGLANG_LOADS",
    "SHARED_MEMORY",
    "held_files",
    "remove_files",
    "remove_folder",
    "remove_when_gone",
    "temp_folder_for_children",
]

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
def temp_folder_for_children(prefix: str, keep: Iterable[Path] = ()) -> Iterator[Path]:
    """A new temporary folder that processes started inside the block take as theirs; the folder (its owner
    removes it with :func:`remove_folder` once those processes are gone).

    Inside the block ``TMPDIR`` (read by a spawned process) and :data:`tempfile.tempdir` (inherited by a forked
    one) name the folder; both are restored when the block ends.  Temporary files this process makes meanwhile go
    there too, so keep the block to the start of the processes.  ``keep``: folders of the machine's temporary
    folder the processes go on sharing with every other (caches): each is linked into the new folder under its
    own name, so a process that finds it under ``TMPDIR`` uses the shared one; removing the folder removes the
    link, never what it points to.
    """
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    for shared in keep:
        with contextlib.suppress(OSError):  # without the link the processes make their own copy, as before
            shared.mkdir(parents=True, exist_ok=True)
            (folder / shared.name).symlink_to(shared, target_is_directory=True)
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


#: The watcher of :func:`remove_when_gone`: removes the folder once the process has exited (or ends when the folder
#: is gone); the engine's own processes follow their parent, and get a few seconds to do so.
_WATCHER = """
import os, shutil, sys, time
pid, folder = int(sys.argv[1]), sys.argv[2]
while os.path.exists(folder):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        time.sleep(5)
        shutil.rmtree(folder, ignore_errors=True)
        break
    time.sleep(1)
"""


def remove_when_gone(folder: Path) -> subprocess.Popen | None:
    """Start a watcher process (its own session, so it outlives this one) that removes ``folder`` once this process
    has exited, in case it is killed before it removes the folder itself; it ends by itself once the folder is
    gone.  ``None`` when it cannot start (logged: the folder is then removed only by a clean shutdown)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(folder)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        logger.warning("daskgen: no watcher for %s (%s); it is removed at a clean shutdown only", folder, exc)
        return None
