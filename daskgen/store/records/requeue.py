"""The requeue record: committed prompts a follower sent back for generation (``stale="regenerate"``).

Only the run's client writes ``status``, so a follower that finds a prompt too stale to deliver does not
reset it itself: it adds the prompt to the record ``daskgen.requeue`` at the root of the store (JSON,
``{"rows": [[row, seq], ...]}``: the row and the commit that made it done), before its cursor may pass that
commit.  The record is replaced in one atomic write (write-temp-and-rename in a folder, one conditional PUT on
object storage), compared with what was read first, so followers adding rows and a client taking them never
lose each other's change.  A ``daskgen run`` starting on the store resets the recorded rows to pending
through its commit path and generates them again (:mod:`daskgen.client.requeue`), then drops them from the
record: a row is reset only while it is still done by the recorded commit, so taking an entry twice (after a
crash in between) changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from daskgen.errors import StoreError
from daskgen.store.commit_log import REQUEUE_KEY
from daskgen.store.location import StoreLocation

#: Attempts at replacing the record while others replace it too.
_ATTEMPTS = 20

#: A requeued prompt: ``(row, seq)``, the row and the commit sequence number that made it done.
Entry = tuple[int, int]


def read_requeue(location: StoreLocation) -> set[Entry]:
    """The prompts waiting to be generated again (empty when there is no record)."""
    raw = location.read_bytes(REQUEUE_KEY)
    return set() if raw is None else _parse(raw, location)


def add_requeue(location: StoreLocation, entries: Iterable[Entry]) -> None:
    """Add ``entries`` to the record (rows already in it stay once)."""
    new = {(int(r), int(s)) for r, s in entries}
    if new:
        _update(location, lambda old: old | new)


def drop_requeue(location: StoreLocation, entries: Iterable[Entry]) -> None:
    """Remove ``entries`` from the record (the client took them)."""
    gone = set(entries)
    if gone:
        _update(location, lambda old: old - gone)


def _update(location: StoreLocation, change: Callable[[set[Entry]], set[Entry]]) -> None:
    def encoded(raw: bytes | None) -> bytes | None:
        old = set() if raw is None else _parse(raw, location)
        new = change(old)
        return None if new == old else json.dumps({"rows": sorted([list(e) for e in new])}).encode()

    if location.update_object(REQUEUE_KEY, encoded, _ATTEMPTS):
        return
    raise StoreError(
        f"could not update the requeue record {location.url}/{REQUEUE_KEY}: it kept changing under {_ATTEMPTS} "
        "attempts (other followers or a run). Nothing was acknowledged: follow again."
    )


def _parse(raw: bytes, location: StoreLocation) -> set[Entry]:
    try:
        return {(int(r), int(s)) for r, s in json.loads(raw)["rows"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(
            f"{location.url}/{REQUEUE_KEY} is not a daskgen requeue record ({type(exc).__name__}: {exc}); it is "
            'replaced in one atomic write, so it was changed outside daskgen. Expected {"rows": [[row, seq], ...]}; '
            "delete it (the prompts it listed then stay done, not delivered to the followers that sent them back) or "
            "write the rows to generate again."
        ) from exc
