"""Prefix-aware dispatch: prompts that share a prefix reach an engine together, one writer per chunk.

An engine computes a prefix its prefix cache holds only once; requests sharing a long system prompt
that reach it mixed with others make it compute the prefix again each time the cache has dropped it.
With ``dispatch: prefix`` (or ``auto`` when the input has shared prefixes worth it,
:meth:`~daskgen.input.prefix.PrefixKeys.worth_it`) a partition stays one task that writes its own chunk
(no locks, every guarantee of a partition task unchanged), and:

1. **Within a partition** the worker sends the requests to its engine in prompt order
   (:func:`daskgen.worker.prefix_order.prompt_order`), so that rows sharing a prefix are admitted one
   after the other: the engine computes each shared prefix once per partition however the input mixes
   them.  Not for an engine that admits its waiting requests by shared prefix itself
   (:meth:`~daskgen.engines.base.Engine.prefix_admission`: sglang under ``lpm``, which such runs start it
   with): it computes a prefix once for requests that wait together in any order, but not when they all
   reach one prefill batch, which sorted requests arriving one after the other do.
2. **Across partitions** a partition whose rows mostly share one prefix key (:func:`partition_key`) goes
   to a worker that ran that key last (:class:`TaskPool`): when a free worker asks for a task it gets,
   from the next tasks of the input (a look-ahead of at most half of ``max_prompts_in_memory``
   prompts), one of the key it ran last; else one without a key; else one of a key no worker holds yet;
   else one of the key held by the fewest workers.  A free worker always gets a task when one can go:
   no engine waits for its "own" prefix.

Which key each task had and where it went is kept in the store's attrs (``dispatch``) for analysis.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np

from daskgen.input.prefix import NO_KEY, PrefixKeys, PrefixScan
from daskgen.input.rows import InputScan, iter_token_ids
from daskgen.worker.task import PartitionTask

logger = logging.getLogger(__name__)

#: Keys a worker remembers as its own (most recent first).
HELD_KEYS = 4
#: Tasks listed in the store's ``dispatch`` record at most (the attrs are read whenever the store is opened).
MAX_RECORDED_TASKS = 10_000


def resolve_prefix(
    mode: str, scan: InputScan, kept: dict[str, Any] | None, tokenizer: Any, template: Any
) -> PrefixKeys | None:
    """The prefix keys dispatch goes by, or ``None`` to keep input order.

    ``mode`` is the ``dispatch`` setting; ``kept`` the store's kept input scan (a reused scan has no keys:
    they are computed again, with its prefix length, in one tokenizing pass, when that length is known).
    """
    if mode == "order":
        return None
    keys = scan.prefix
    if keys is None:
        n_tokens = int(((kept or {}).get("prefix") or {}).get("n_tokens", 0))
        keys = _rescan(scan, n_tokens, tokenizer, template) if n_tokens else None
    if keys is None or not keys.n_keys:
        if mode == "prefix":
            logger.info("dispatch: prefix, but no prompts share a prefix: tasks go in input order")
        return None
    if mode == "auto" and not keys.worth_it():
        logger.info("dispatch auto: shared prefixes too short or rare (%s): input order", keys.summary())
        return None
    logger.info("dispatch by prefix: %s", keys.summary())
    return keys


def _rescan(scan: InputScan, n_tokens: int, tokenizer: Any, template: Any) -> PrefixKeys:
    """The keys of a reused input scan: every prompt tokenized again, hashed at ``n_tokens``."""
    prefixes = PrefixScan(n_tokens)
    for _, tokens, _ in iter_token_ids(scan.source, tokenizer, iter(range(len(scan))), template):
        prefixes.add(tokens)
    return prefixes.result()


def partition_key(keys: np.ndarray, rows: list[int]) -> int:
    """The prefix key held by more than half of ``rows``, else :data:`NO_KEY` (a mixed partition)."""
    held = keys[np.asarray(rows, dtype=np.int64)]
    held = held[held != NO_KEY]
    if not held.size:
        return NO_KEY
    values, counts = np.unique(held, return_counts=True)
    best = int(np.argmax(counts))
    return int(values[best]) if 2 * counts[best] > len(rows) else NO_KEY


def with_prefix(task: PartitionTask, keys: np.ndarray, prompt_order: bool = True) -> PartitionTask:
    """``task`` with its :func:`partition_key`, sent in prompt order unless ``prompt_order`` is false."""
    return dataclasses.replace(task, prefix_key=partition_key(keys, task.rows), prefix_order=prompt_order)


class TaskPool:
    """The next tasks of the run, and which one a free worker gets (module doc).

    ``lookahead_rows``: rows held in the pool beyond the first task (0: input order, one task at a time).
    """

    def __init__(self, tasks: Iterator[PartitionTask], lookahead_rows: int = 0) -> None:
        self.tasks, self.lookahead_rows = tasks, lookahead_rows
        self.pool: list[PartitionTask] = []
        self.pooled_rows = 0  # rows of the tasks in the pool
        self.held: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)  # worker -> its keys
        self.homes: Counter[int] = Counter()  # key -> workers holding it
        self.placed: list[tuple[int, int, str]] = []  # (partition start, key, worker) of each task sent
        self.exhausted = False

    def take(self, worker: str | None) -> PartitionTask | None:
        """The task for a free slot of ``worker`` (``None``: any worker), or ``None`` when none is left."""
        self._fill()
        if not self.pool:
            return None
        task = self.pool.pop(self._choose(worker))
        self.pooled_rows -= len(task.rows)
        self.started(task, worker)
        return task

    def started(self, task: PartitionTask, worker: str | None) -> None:
        """``task`` goes to ``worker``: the key becomes the worker's."""
        self.placed.append((task.start, task.prefix_key, worker or ""))
        if worker is None or task.prefix_key == NO_KEY:
            return
        held = self.held[worker]
        if task.prefix_key not in held:
            self.homes[task.prefix_key] += 1
            if len(held) >= HELD_KEYS:
                self.homes[held.popitem(last=False)[0]] -= 1
        held[task.prefix_key] = None
        held.move_to_end(task.prefix_key)

    def _fill(self) -> None:
        """Pull tasks until the pool holds ``lookahead_rows`` rows and at least one task (or the input ended)."""
        while not self.exhausted:
            if self.pool and self.pooled_rows >= self.lookahead_rows:
                return
            task = next(self.tasks, None)
            if task is None:
                self.exhausted = True
                return
            self.pool.append(task)
            self.pooled_rows += len(task.rows)

    def _choose(self, worker: str | None) -> int:
        """Index in the pool of the task for ``worker``: its own latest key, no key, a new key, the rarest key."""
        keys = [t.prefix_key for t in self.pool]
        if worker is not None:
            for key in reversed(self.held[worker]):
                if key in keys:
                    return keys.index(key)
        if NO_KEY in keys:
            return keys.index(NO_KEY)
        return min(range(len(keys)), key=lambda j: (self.homes[keys[j]], j))

    def record(self, keys: PrefixKeys | None, prompt_order: bool = True) -> dict[str, Any]:
        """What the store's attrs keep: the mode, the keys' summary, whether partitions went in prompt order, the
        number of tasks and the first :data:`MAX_RECORDED_TASKS` tasks' (partition start, key, worker index)."""
        workers = sorted({w for _, _, w in self.placed})
        index = {w: i for i, w in enumerate(workers)}
        return {
            "mode": "order" if keys is None else "prefix",
            **({"prefix": keys.summary(), "prompt_order": prompt_order} if keys is not None else {}),
            "workers": workers,
            "n_tasks": len(self.placed),
            "tasks": [[start, key, index[w]] for start, key, w in self.placed[:MAX_RECORDED_TASKS]],
        }
