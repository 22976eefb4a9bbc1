"""Durable consumer positions: one small JSON object per cursor name, replaced atomically on each ack.

A cursor records the set of acknowledged commits as a commit-order position ``(seq, row)``: everything
committed at or before it (commit sequence number, then row index; :mod:`daskgen.store.commit_log`)
was delivered and acknowledged; and, for a follower that delivers out of commit order (``order="window"``),
``ahead``: the ``(seq, row)`` commits after the position that were acknowledged too, kept as ranges of
rows per commit (``[seq, first_row, last_row]``; the position moves over them as the gaps before them
fill).  By default cursors live inside the store, at ``daskgen.cursors/<name>.json`` (written with
write-temp-and-rename in a folder, one PUT on object storage: a reader sees the old or the new position,
never a mix); ``cursor_dir`` keeps them in another folder or URL instead (e.g. for a store you may only
read).

A cursor is kept at a location, not through :class:`~daskgen.store.generation_store.GenerationStore`:
a ``cursor_dir`` is no store, and a follower loads its cursor before a run has created the store.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

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


#: ``(seq, row)`` commits acknowledged after a cursor's position, sorted.
Ahead = tuple[tuple[int, int], ...]


@dataclass
class CursorState:
    """What a cursor records: what it acknowledged (position and ``ahead``), counts, and its window's wait.

    ``order``, ``window``, ``head``, ``head_wait`` and ``max_head_wait`` describe the follower that last
    acknowledged (shown by ``daskgen status``): for ``order="window"``, its window size, the first prompt
    (input order) it had not delivered, and the seconds its acknowledged batches waited for the window's
    head (summed, and the longest wait of one batch).  ``max_staleness`` is the bound of a follower with one
    (``None``: none), ``stale`` the samples it delivered flagged too stale, ``requeued`` the prompts it sent
    back for generation.
    """

    position: Position = Position()
    batches: int = 0  # batches acknowledged
    prompts: int = 0  # done prompt groups acknowledged
    failed: int = 0  # failed prompts reported in acknowledged batches
    ahead: Ahead = ()
    order: str = "commit"
    window: int | None = None
    head: int | None = None
    head_wait: float = 0.0
    max_head_wait: float = 0.0
    max_staleness: int | None = None
    stale: int = 0
    requeued: int = 0

    def to_json(self) -> dict[str, Any]:
        """The cursor object's fields."""
        doc: dict[str, Any] = {"seq": self.position.seq, "row": self.position.row, "batches": self.batches}
        doc |= {"prompts": self.prompts, "failed": self.failed, "order": self.order}
        if self.ahead:
            doc["ahead"] = ahead_ranges(self.ahead)
        if self.order == "window":
            doc |= {"window": self.window, "head": self.head}
            doc |= {"head_wait_s": round(self.head_wait, 3), "max_head_wait_s": round(self.max_head_wait, 3)}
        if self.max_staleness is not None or self.stale or self.requeued:
            doc |= {"max_staleness": self.max_staleness, "stale": self.stale, "requeued": self.requeued}
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CursorState:
        """Read a cursor object (``KeyError``, ``TypeError`` or ``ValueError`` when it is not one)."""
        window, head, bound = doc.get("window"), doc.get("head"), doc.get("max_staleness")
        return cls(
            Position(int(doc["seq"]), int(doc["row"])),
            int(doc["batches"]),
            int(doc["prompts"]),
            int(doc["failed"]),
            ahead_from_ranges(doc.get("ahead", [])),
            str(doc.get("order", "commit")),
            None if window is None else int(window),
            None if head is None else int(head),
            float(doc.get("head_wait_s", 0.0)),
            float(doc.get("max_head_wait_s", 0.0)),
            None if bound is None else int(bound),
            int(doc.get("stale", 0)),
            int(doc.get("requeued", 0)),
        )


def ahead_ranges(ahead: Ahead) -> list[list[int]]:
    """``[[seq, first_row, last_row], ...]``: runs of consecutive rows of one commit."""
    ranges: list[list[int]] = []
    for seq, row in ahead:
        if ranges and ranges[-1][0] == seq and ranges[-1][2] == row - 1:
            ranges[-1][2] = row
        else:
            ranges.append([seq, row, row])
    return ranges


def ahead_from_ranges(ranges: Any) -> Ahead:
    """The commits of :func:`ahead_ranges`' ranges (``ValueError`` on anything else)."""
    if not isinstance(ranges, list):
        raise ValueError(f"'ahead' must be a list of [seq, first_row, last_row], got {ranges!r}")
    pairs: list[tuple[int, int]] = []
    for item in ranges:
        seq, first, last = (int(v) for v in item)
        if last < first:
            raise ValueError(f"'ahead' range {item!r} ends before it starts")
        pairs.extend((seq, row) for row in range(first, last + 1))
    return tuple(sorted(pairs))


def commit_keys(seqs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """One int64 per ``(seq, row)`` commit, ordered as commit order (rows are below 2**32)."""
    return (np.asarray(seqs, np.int64) << 32) | np.asarray(rows, np.int64)


def not_acknowledged(state: CursorState, seqs: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Mask of the ``(seq, row)`` commits that ``state`` did not acknowledge."""
    at = state.position
    after = (seqs > at.seq) | ((seqs == at.seq) & (rows > at.row))
    if state.ahead:
        after &= ~np.isin(commit_keys(seqs, rows), commit_keys(*np.array(state.ahead, np.int64).T))
    return after


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
            return CursorState.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise FollowError(
                f"cursor file {self.url!r} is not a daskgen cursor: {type(exc).__name__}: {exc} (it holds "
                f"{len(raw)} bytes, starting {raw[:60]!r}). daskgen replaces it in one atomic write, so it was "
                "cut short or overwritten outside daskgen (a file system that lost data, a copy, an edit). Fix: "
                'write the position of the last batch your consumer made durable, {"seq": S, "row": R, "batches": '
                'B, "prompts": P, "failed": F} (its batch.end is Position(S, R), its batch.number + 1 is B; with '
                'order="window" also its batch.ahead, as "ahead": [[seq, first_row, last_row], ...]: runs of rows '
                "of one commit); or "
                "delete the file to start this cursor from the beginning (every batch is delivered again); or "
                "follow with another cursor name."
            ) from exc

    def save(self, state: CursorState) -> None:
        """Replace the cursor with ``state`` in one atomic write.

        A cursor kept in the store never re-creates the store's folder: while ``daskgen pack`` swaps the
        store in place (the folder is away for a moment) the ack raises :class:`FollowError`; nothing was
        acknowledged, and acknowledging again once the swap is over works.
        """
        doc = state.to_json() | {"cursor": self.name, "updated": utc_now()}
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
