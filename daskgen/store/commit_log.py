"""The commit log's head: the newest commit whose every write landed, kept beside the arrays.

Each client commit gives the rows whose status it changes the next commit sequence number (the
``commit_seq`` array, written before ``status``) and, after ``status``, replaces the small head object
``daskgen.commits`` (JSON: ``seq``, ``time``) in one atomic write.  A reader that reads the head first
and the arrays after it sees every row of every commit up to the head's ``seq`` complete, whatever
commits come later (:mod:`daskgen.stream` delivers in this order).  Per-cursor consumer positions
live under :data:`CURSORS_PREFIX` (:mod:`daskgen.store.records.cursors`).
"""

from __future__ import annotations

import json
import time

from daskgen.store.location import StoreLocation

#: The head object, at the root of the store (beside ``daskgen.lock``).
HEAD_KEY = "daskgen.commits"
#: Folder (key prefix) of the follow cursors inside a store.
CURSORS_PREFIX = "daskgen.cursors"
#: The policy record: the versions a trainer published (:mod:`daskgen.store.policy`).
POLICY_KEY = "daskgen.policy"
#: Folder (key prefix) of the workers' policy states: the version each engine runs, a refresh loading or failed.
POLICY_WORKERS_PREFIX = "daskgen.policy.workers"
#: Folder (key prefix) of the deltas of delta policy versions, one object per version (:mod:`daskgen.store.policy`).
POLICY_DELTAS_PREFIX = "daskgen.policy.deltas"
#: The requeue record: committed prompts a follower sent back for generation (:mod:`daskgen.store.records.requeue`).
REQUEUE_KEY = "daskgen.requeue"
#: The Dask event topic on which a run announces each commit (``{"store": url, "seq": n}``) and, when it stops
#: streaming, its end (``{"store": url, "seq": n, "ending": True}``): hints to followers.
COMMIT_TOPIC = "daskgen-commits"
#: The Dask event topic on which a follower announces additions to the requeue record (``{"store": url}``), a hint
#: to the run writing the store (:class:`daskgen.client.requeue.LiveRequeue`).
REQUEUE_TOPIC = "daskgen-requeue"
#: The Dask event topic on which a publisher announces a new policy version (``{"store": url, "version": n}``):
#: the run's workers on that cluster look at the policy record at once instead of at their next poll.
POLICY_TOPIC = "daskgen-policy"
#: Objects of a store outside zarr that belong to its commit log, its consumers, its policy record (with the deltas
#: of its delta versions) and its requeue record (kept by ``daskgen pack``).
LOG_KEYS = (HEAD_KEY, CURSORS_PREFIX, POLICY_KEY, POLICY_DELTAS_PREFIX, REQUEUE_KEY)


def write_head(location: StoreLocation, seq: int) -> None:
    """Record that every write of commit ``seq`` (and of all commits before it) landed."""
    location.write_object(HEAD_KEY, json.dumps({"seq": int(seq), "time": time.time()}).encode())


def read_head(location: StoreLocation) -> int:
    """The ``seq`` of the newest complete commit (0 when the store has no head: no commit recorded one)."""
    raw = location.read_bytes(HEAD_KEY)
    if raw is None:
        return 0
    try:
        return int(json.loads(raw)["seq"])
    except (ValueError, KeyError, TypeError):  # written atomically: a bad head is a foreign object
        return 0
