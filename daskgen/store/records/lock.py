"""One live client per store: a lock object with owner, start time and a heartbeat.

The lock is ``<store>/daskgen.lock`` (JSON: host, pid, started, heartbeat).  It is created only if
absent (``O_CREAT|O_EXCL`` in a folder, a conditional PUT on object storage); a second client is
refused with the owner's details.  A lock is stale —
and taken over — when its owner is a dead process on this host, or when its heartbeat (refreshed
by the running client) is older than ``stale_after`` seconds (owner on another host).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from daskgen import tunables
from daskgen.errors import StoreLockedError
from daskgen.store.location import StoreLocation, describe_failure, locate, write_failures

logger = logging.getLogger(__name__)

LOCK_NAME = "daskgen.lock"


def _parse(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # half-written by a killed client: stale by definition (no pid)
    return doc if isinstance(doc, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(holder: dict[str, Any], stale_after: float) -> bool:
    """True when the lock ``holder`` (its parsed JSON) is a dead process on this host, or its heartbeat is
    older than ``stale_after`` seconds."""
    if not holder.get("pid"):
        return True
    if holder.get("host") == socket.gethostname():
        return not _pid_alive(int(holder["pid"]))
    return time.time() - float(holder.get("heartbeat", 0)) > stale_after


def live_holder(location: StoreLocation) -> dict[str, Any] | None:
    """The holder of the store's lock when a live run holds it (host, pid, started, heartbeat), else ``None``."""
    raw = location.read_bytes(LOCK_NAME)
    if raw is None:
        return None
    holder = _parse(raw)
    return None if is_stale(holder, tunables.seconds("lock.stale-after")) else holder


class StoreLock:
    """Context manager holding the store's lock for the duration of a run.

    The lock is one object written through the store's :class:`~daskgen.store.location.StoreLocation`:
    created only if absent (``O_EXCL`` on a folder; ``If-None-Match: *`` on S3, the equivalent
    preconditions on GCS/Azure), and replaced only if unchanged since it was read (take-over of a
    stale lock, heartbeats: compare-then-rename on a folder; ``If-Match: <ETag>`` on object storage).
    """

    def __init__(self, store_path: str | Path | StoreLocation, *, stale_after: float | None = None) -> None:
        self.location = locate(store_path)
        self.path = f"{self.location.url}/{LOCK_NAME}"
        self.stale_after = tunables.seconds("lock.stale-after") if stale_after is None else stale_after
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        }
        self._last_beat = 0.0
        self.heartbeat_interval = tunables.seconds("lock.heartbeat-interval")
        self._version: Any = None
        self.took_over: dict[str, Any] | None = None

    def _doc(self) -> bytes:
        return json.dumps({**self.owner, "heartbeat": time.time()}).encode()

    def acquire(self) -> StoreLock:
        """Take the lock, taking over a stale one; raise :class:`StoreLockedError` if it is live."""
        for _ in range(3):
            doc = self._doc()
            if self.location.create_object(LOCK_NAME, doc):
                self._taken(doc)
                return self
            current = self.location.read_versioned(LOCK_NAME)
            if current is None:
                continue  # released meanwhile
            holder = _parse(current[0])
            if not self._is_stale(holder):
                raise StoreLockedError(self._refusal(holder))
            self.took_over = holder
            version = self.location.replace_object(LOCK_NAME, doc, current[1])
            if version is not None:  # nobody else took it over between our read and write
                self._version = version
                self._last_beat = time.monotonic()
                return self
        raise StoreLockedError(f"could not take the lock {self.path!r}: another client keeps taking it")

    def _taken(self, doc: bytes) -> None:
        """After creating the lock: probe whether the store honours create-if-absent, then note its version.

        The probe's bytes differ from the lock's: a create that fails its condition when repeated counts as
        done when the object holds the bytes it wrote (a first attempt whose answer was lost), so a probe
        with the lock's own bytes would always seem to succeed.
        """
        probe = json.dumps({**json.loads(doc), "probe": True}).encode()
        if not self.location.is_local and self.location.create_object(LOCK_NAME, probe):
            logger.warning(
                "the object store at %s ignores conditional writes (If-None-Match): the lock cannot "
                "keep a second client out; run one client per store yourself",
                self.location.url,
            )
        current = self.location.read_versioned(LOCK_NAME)
        self._version = None if current is None else current[1]
        self._last_beat = time.monotonic()

    def heartbeat(self, *, force: bool = False) -> None:
        """Refresh the heartbeat (cheap; writes at most every ``daskgen.lock.heartbeat-interval``, 30 s).

        ``force=True`` writes now, whenever the last write was.

        Raises :class:`StoreLockedError` when another client took the lock over meanwhile (this run's
        heartbeat had stopped for longer than ``stale_after``): two clients must not commit to one store.
        """
        if not force and time.monotonic() - self._last_beat < self.heartbeat_interval:
            return
        try:
            version = self.location.replace_object(LOCK_NAME, self._doc(), self._version)
        except write_failures() as exc:  # storage unreachable for now: the run goes on, the next beat retries
            logger.warning(
                "could not refresh the lock %s (%s); retrying at the next heartbeat", self.path, describe_failure(exc)
            )
            return
        if version is None:
            raise self._taken_over()
        self._version = version
        self._last_beat = time.monotonic()

    def _taken_over(self) -> StoreLockedError:
        """The error for a lock another client took over, naming its new holder."""
        current = self.location.read_versioned(LOCK_NAME)
        holder = _parse(current[0]) if current else {}
        return StoreLockedError(
            f"lost the lock {self.path!r}: it was taken over by host {holder.get('host')}, "
            f"pid {holder.get('pid')} after this run's heartbeat stopped for more than "
            f"{self.stale_after:.0f} s. Stop one of the two runs; rerun to resume."
        )

    def release(self) -> None:
        """Remove the lock if it is still ours; when the store cannot be reached, say so and leave it to expire."""
        try:
            current = self.location.read_versioned(LOCK_NAME)
            holder = {} if current is None else _parse(current[0])
            if holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]:
                self.location.delete_object(LOCK_NAME)
        except write_failures() as exc:
            logger.warning(
                "could not remove the lock %s (%s): the next run takes it over once its heartbeat is %.0f s old",
                self.path,
                describe_failure(exc),
                self.stale_after,
            )

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        return is_stale(holder, self.stale_after)

    def _refusal(self, holder: dict[str, Any]) -> str:
        return (
            f"store {self.location.url!r} is in use by another daskgen run (host {holder.get('host')}, "
            f"pid {holder.get('pid')}, started {holder.get('started')}). Wait for it to finish or stop it; "
            f"if that run is dead on another host, its lock expires {self.stale_after:.0f} s after its last "
            f"heartbeat, or delete {self.path!r}."
        )

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
