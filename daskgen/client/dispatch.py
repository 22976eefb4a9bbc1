"""Length-aware dispatch: which partitions start first, and how long the run's tail was.

A partition ends with its slowest sample, and a job ends with its slowest partition, so likely-long
partitions should start first: then they overlap the rest of the job instead of forming its tail.
What is known about lengths before generating, in the order partitions are dispatched:

1. **Interrupted partitions.**  A partition whose responses were interrupted (a stop, a preemption,
   an engine restart) holds samples that were still running when everything around them had
   finished — the long ones.  The client records them in the store's attrs (``partial_partitions``) when a run
   ends; a resumed run starts with them.
2. **Length hints** (``length_hints``: an earlier store of the same prompts).  Samples of one prompt
   have similar lengths, so the longest response an earlier run stored for a prompt predicts its
   partition's length (:func:`read_length_hints`).  The partitions predicted longest — up to half of
   ``max_prompts_in_memory`` prompts' worth, read in one extra pass over the input and held — go
   next, longest first (:func:`long_first`).
3. The others, in input order.

Once partitions run, each worker admits more of them while its engine's batch has room
(:mod:`daskgen.worker.admission`), so a partition kept alive by one long sample does not idle the engine.

The *tail share* of a run (:mod:`daskgen.tail`) — the fraction of its generating time spent committing
the last 10 % of its prompts — says how much the tail cost; it is printed and kept in the run history.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from daskgen.errors import ConfigError


def dispatch_order(starts: Iterable[int], first: Iterable[int]) -> tuple[list[int], list[int]]:
    """Split partition ``starts`` into (those in ``first``, the others), each ascending."""
    starts, first = sorted(set(starts)), set(first)
    return [s for s in starts if s in first], [s for s in starts if s not in first]


def read_length_hints(where: Any, ids: list[str], fingerprint: str, n_rows: int) -> np.ndarray:
    """Per row of this run's input (``ids``, ``fingerprint``): the longest response the store at
    ``where`` holds for the same prompt, ``NaN`` where it has none.

    Rows are matched by position when both stores were made from the same input (same fingerprint),
    else by the input's ``id`` column.  Raises :class:`~daskgen.errors.ConfigError` when ``where`` is
    not a daskgen store, or the inputs differ and the rows have no ids to match by.
    """
    from daskgen.store.generation_store import GenerationStore
    from daskgen.store.identity import not_a_store

    hints = GenerationStore.open_if_exists(where)
    if hints is None:
        raise ConfigError(
            f"length_hints: {not_a_store(where)} Expected the --store of an earlier run over the same prompts, "
            "or leave --length-hints out."
        )
    longest, stored_ids = _longest_per_row(hints)
    if hints.attrs.input.get("fingerprint") == fingerprint and len(longest) == n_rows:
        return longest
    return _match_by_id(where, ids, stored_ids, longest)


def _longest_per_row(hints: Any) -> tuple[np.ndarray, list[str]]:
    """The longest response (sample or agent trajectory) per row of the store ``hints`` (NaN: none), and row ids."""
    from daskgen.store.layout import NOT_GENERATED

    n = hints.layout.n_prompts
    arrays = hints.read_region(0, n, ("response_length", "finish_reason", "prompt_id"))
    generated = arrays["finish_reason"] != NOT_GENERATED
    longest = np.where(generated, arrays["response_length"], -1).reshape(n, -1).max(axis=1).astype(np.float64)
    longest[longest < 0] = np.nan
    return longest, [str(x) for x in arrays["prompt_id"]]


def _match_by_id(where: Any, ids: list[str], stored_ids: list[str], longest: np.ndarray) -> np.ndarray:
    """``longest`` (per stored row) rearranged to this run's rows by their input ``id``; NaN for unknown ids."""
    if not all(ids) or not all(stored_ids):
        raise ConfigError(
            f"length_hints: {where.url!r} was made from other prompts (input fingerprint differs) and "
            "rows without an 'id' cannot be matched; give every input row an 'id' column (in both "
            "runs), or use a store of exactly this input."
        )
    by_id = dict(zip(stored_ids, longest, strict=True))
    return np.array([by_id.get(key, np.nan) for key in ids], dtype=np.float64)


def long_first(
    starts: list[int], predicted: np.ndarray, partition_size: int, limit: int
) -> tuple[list[int], list[int]]:
    """Split ascending partition ``starts`` into (the at most ``limit`` partitions predicted longest,
    longest first; the others, ascending).  A partition's predicted length is the largest ``predicted``
    of its rows (``NaN``: unknown); partitions with no prediction are among the others."""
    keys = {}
    for start in starts:
        known = predicted[start : start + partition_size]
        known = known[np.isfinite(known)]
        if known.size:
            keys[start] = float(known.max())
    chosen = sorted(keys, key=lambda s: (-keys[s], s))[: max(0, limit)]
    picked = set(chosen)
    return chosen, [s for s in starts if s not in picked]


def still_partial(previous: Iterable[int], new: Iterable[int], pending_starts: Iterable[int]) -> list[int]:
    """Partitions to record: earlier and new ones with partial responses that still have pending rows."""
    pending = set(pending_starts)
    return sorted((set(previous) | set(new)) & pending)
