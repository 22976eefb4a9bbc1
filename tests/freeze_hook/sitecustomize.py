"""Test double, labelled: freeze the process that writes one chunk, so a test can SIGKILL it at that moment.

Loaded by Python at start-up (``sitecustomize``) in every process whose ``PYTHONPATH`` holds this folder:
the ``daskgen run`` client, its LocalCluster's nannies and worker processes.  It does nothing unless
``DASKGEN_TEST_FREEZE`` is set (JSON: ``key``, ``mode``, ``marker``).  Then it wraps zarr's local-store
write (``zarr.storage._local._atomic_write``, the real function that writes a chunk to a temporary file
and renames it into place) so that the first write of a chunk whose key ends with ``key``:

* ``mode="after"``: completes (the chunk is in place), then
* ``mode="torn"``: writes only the first half of the chunk's bytes into zarr's temporary file, then

creates ``marker`` holding the process id and sleeps for ever.  The test waits for ``marker`` and sends
SIGKILL to that process.  Only one process fires (``marker`` is created exclusively), so the process
that replaces a killed worker, and the rerun, write normally.  Nothing here changes what zarr writes:
the half-written temporary file is the one zarr's own code opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import time


def _fire(marker: str) -> bool:
    try:
        fd = os.open(marker + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _freeze(marker: str) -> None:
    tmp = marker + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, marker)
    while True:
        time.sleep(3600)


class _TornFile:
    """Writes half of what it is given, then freezes the process."""

    def __init__(self, fh, marker: str) -> None:
        self.fh, self.marker = fh, marker

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.fh.write(view[: len(view) // 2])
        self.fh.flush()
        os.fsync(self.fh.fileno())
        _freeze(self.marker)
        return 0  # not reached


def _install(spec: dict) -> None:
    import zarr.storage._local as local

    real = local._atomic_write

    @contextlib.contextmanager
    def atomic_write(path, mode, exclusive=False):
        hit = str(path).replace(os.sep, "/").endswith(spec["key"]) and _fire(spec["marker"])
        if hit and spec["mode"] == "torn":
            with real(path, mode, exclusive=exclusive) as fh:
                yield _TornFile(fh, spec["marker"])
            return
        with real(path, mode, exclusive=exclusive) as fh:
            yield fh
        if hit:
            _freeze(spec["marker"])

    local._atomic_write = atomic_write


if os.environ.get("DASKGEN_TEST_FREEZE"):
    _install(json.loads(os.environ["DASKGEN_TEST_FREEZE"]))
