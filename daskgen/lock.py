"""One live client per store: a lock file with owner, start time and a heartbeat.

The lock is ``<store>/daskgen.lock`` (JSON: host, pid, started, heartbeat).  It is taken with
``O_CREAT|O_EXCL``; a second client is refused with the owner's details.  A lock is stale —
and taken over — when its owner is a dead process on this host, or when its heartbeat (refreshed
by the running client) is older than ``stale_after`` seconds (owner on another host).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from daskgen import tunables
from daskgen.errors import StoreLockedError

LOCK_NAME = "daskgen.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StoreLock:
    """Context manager holding the store's lock for the duration of a run."""

    def __init__(self, store_path: str | Path, *, stale_after: float | None = None) -> None:
        self.path = Path(store_path) / LOCK_NAME
        self.stale_after = tunables.seconds("lock.stale-after") if stale_after is None else stale_after
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(),
                      "started": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        self._last_beat = 0.0
        self.took_over: dict[str, Any] | None = None

    def acquire(self) -> StoreLock:
        """Take the lock, taking over a stale one; raise :class:`StoreLockedError` if it is live."""
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is not None and not self._is_stale(holder):
                    raise StoreLockedError(self._refusal(holder)) from None
                self.took_over = holder
                self._remove_if_unchanged(holder)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump({**self.owner, "heartbeat": time.time()}, fh)
            self._last_beat = time.monotonic()
            return self
        raise StoreLockedError(f"could not take the lock {str(self.path)!r}: another client keeps taking it")

    def heartbeat(self) -> None:
        """Refresh the heartbeat (cheap; writes at most every ``daskgen.lock.heartbeat-interval``, 30 s)."""
        if time.monotonic() - self._last_beat < tunables.seconds("lock.heartbeat-interval"):
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.owner, "heartbeat": time.time()}))
        os.replace(tmp, self.path)
        self._last_beat = time.monotonic()

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        holder = self._read()
        if holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]:
            self.path.unlink(missing_ok=True)

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {}  # half-written by a killed client: stale by definition below

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        if not holder.get("pid"):
            return True
        if holder.get("host") == self.owner["host"]:
            return not _pid_alive(int(holder["pid"]))
        return time.time() - float(holder.get("heartbeat", 0)) > self.stale_after

    def _remove_if_unchanged(self, holder: dict[str, Any] | None) -> None:
        if self._read() == holder:
            self.path.unlink(missing_ok=True)

    def _refusal(self, holder: dict[str, Any]) -> str:
        return (f"store {str(self.path.parent)!r} is in use by another daskgen run (host {holder.get('host')}, "
                f"pid {holder.get('pid')}, started {holder.get('started')}). Wait for it to finish or stop it; "
                f"if that run is dead on another host, its lock expires {self.stale_after:.0f} s after its last "
                f"heartbeat, or delete {str(self.path)!r}.")

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
