"""Durable consumer positions: one small JSON object per cursor name, replaced atomically on each ack.

A cursor records the commit-order position of the last acknowledged prompt, ``(seq, row)``: everything
committed at or before it (commit sequence number, then row index; :mod:`daskgen.store.commit_log`)
was delivered and acknowledged.  By default cursors live inside the store, at
``daskgen.cursors/<name>.json`` (written with write-temp-and-rename in a folder, one PUT on object
storage: a reader sees the old or the new position, never a mix); ``cursor_dir`` keeps them in another
folder or URL instead (e.g. for a store you may only read).

A cursor is kept at a location, not through :class:`~daskgen.store.generation_store.GenerationStore`:
a ``cursor_dir`` is no store, and a follower loads its cursor before a run has created the store.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from daskgen.errors import FollowError
from daskgen.store.attrs import utc_now
from daskgen.store.commit_log import CURSORS_PREFIX
from daskgen.store.location import StoreLocation, StoreRef, locate

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True, order=True)
class Position:
    """A place in commit order: after the row ``row`` of commit ``seq`` (``(0, -1)``: before everything)."""

    seq: int = 0
    row: int = -1


@dataclass
class CursorState:
    """What a cursor records: its position and counts of what it acknowledged."""

    position: Position = Position()
    batches: int = 0  # batches acknowledged
    prompts: int = 0  # done prompt groups acknowledged
    failed: int = 0  # failed prompts reported in acknowledged batches


class Cursor:
    """One named cursor of a store, kept at ``<where>/daskgen.cursors/<name>.json``.

    Parameters
    ----------
    store:
        The store's location (where the cursor lives unless ``cursor_dir`` is given).
    name:
        Letters, digits, ``.``, ``_`` and ``-`` (up to 100 characters); independent cursors have
        different names.
    cursor_dir:
        A folder or URL to keep the cursor in instead of the store.
    """

    def __init__(self, store: StoreLocation, name: str, cursor_dir: StoreRef | None = None) -> None:
        if not _NAME.match(name):
            raise FollowError(
                f"cursor name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (up to 100 "
                "characters), starting with a letter or digit, e.g. 'trainer-0'."
            )
        self.name = name
        self.location = store if cursor_dir is None else locate(cursor_dir)
        self.in_store = cursor_dir is None
        self.key = f"{CURSORS_PREFIX}/{name}.json"

    @property
    def url(self) -> str:
        """Where the cursor is kept."""
        return f"{self.location.url}/{self.key}"

    def load(self) -> CursorState:
        """The last acknowledged state (the start of commit order when the cursor was never saved)."""
        raw = self.location.read_bytes(self.key)
        if raw is None:
            return CursorState()
        try:
            doc = json.loads(raw)
            position = Position(int(doc["seq"]), int(doc["row"]))
            return CursorState(position, int(doc["batches"]), int(doc["prompts"]), int(doc["failed"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise FollowError(
                f"cursor file {self.url!r} is not a daskgen cursor: {type(exc).__name__}: {exc} (it holds "
                f"{len(raw)} bytes, starting {raw[:60]!r}). daskgen replaces it in one atomic write, so it was "
                "cut short or overwritten outside daskgen (a file system that lost data, a copy, an edit). Fix: "
                'write the position of the last batch your consumer made durable, {"seq": S, "row": R, "batches": '
                'B, "prompts": P, "failed": F} (its batch.end is Position(S, R), its batch.number + 1 is B); or '
                "delete the file to start this cursor from the beginning (every batch is delivered again); or "
                "follow with another cursor name."
            ) from exc

    def save(self, state: CursorState) -> None:
        """Replace the cursor with ``state`` in one atomic write.

        A cursor kept in the store never re-creates the store's folder: while ``daskgen pack`` swaps the
        store in place (the folder is away for a moment) the ack raises :class:`FollowError`; nothing was
        acknowledged, and acknowledging again once the swap is over works.
        """
        doc = {**asdict(state.position), **{k: v for k, v in asdict(state).items() if k != "position"}}
        doc |= {"cursor": self.name, "updated": utc_now()}
        try:
            self.location.write_object(self.key, json.dumps(doc).encode(), create_location=not self.in_store)
        except FileNotFoundError as exc:
            raise FollowError(
                f"cursor {self.url!r} was not saved: the store's folder {self.location.url!r} is gone (daskgen "
                "pack swapping it in place, or the store was moved or deleted). Nothing was acknowledged: "
                "acknowledge the batch again once the store is back (a follower started again delivers it again)."
            ) from exc


def stored_cursors(store: StoreLocation) -> list[tuple[str, CursorState]]:
    """The cursors kept inside the store (not those in a ``cursor_dir``), by name, with their states."""
    names = sorted(key.rsplit("/", 1)[-1][: -len(".json")] for key, _ in store.files(CURSORS_PREFIX))
    return [(name, Cursor(store, name).load()) for name in names if _NAME.match(name)]
