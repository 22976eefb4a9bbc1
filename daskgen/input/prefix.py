"""Shared-prefix keys: which prompts begin with the same tokens (a system prompt, few-shot examples, a document).

An engine's prefix cache computes a shared prefix once per engine, as long as the requests that share it
reach that engine close in time.  All prompts of a run are known before it starts, so the input scan
gives each prompt a *prefix key* (the hash of its first ``N`` tokens after the chat template) and dispatch
(:mod:`daskgen.client.prefix_dispatch`) hands the rows of one key to the same workers.

Choosing ``N`` (:func:`choose_prefix_length`), from the first ``daskgen.prefix.sample-rows`` prompts of
the input:

* a prefix length ``L`` *saves* ``sum over the L-token prefixes held by several sampled prompts of
  (prompts - 1) * L`` tokens (each such prefix computed once instead of once per prompt);
* ``N`` is the length that saves most: the best of the powers of two from ``daskgen.prefix.min-tokens``
  up to the longest sampled prompt, then the longest length above it (below the next power) at which as
  many prompts still share their prefix — e.g. the end of a shared system prompt, not a few tokens into
  the questions after it, where groups split and save less.

No saving at any length (or a sample of fewer than 2 prompts): no keys.  ``dispatch: auto`` routes by prefix
when the keys would save at least ``daskgen.prefix.min-saving`` of all prompt tokens (each shared prefix
computed once instead of once per row, :meth:`PrefixKeys.saving`), else keeps input order.
Every prompt of at least ``N`` tokens gets the key of its first ``N`` tokens; keys held by a single
prompt are dropped (-1: no shared prefix).  Cost: one hash of ``N`` tokens per prompt, and the sample's
tokens held until ``N`` is chosen.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen import tunables

NO_KEY = -1


def prefix_hash(tokens: Any, n: int) -> int:
    """A non-zero 63-bit hash of the first ``n`` token ids."""
    digest = hashlib.blake2b(np.asarray(tokens[:n], dtype=np.int64).tobytes(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def saved_tokens(sample: Sequence[Any], n: int) -> int:
    """Prompt tokens of ``sample`` not computed if each ``n``-token prefix held by several prompts were
    computed once: ``sum over such prefixes of (prompts - 1) * n``."""
    counts = Counter(prefix_hash(t, n) for t in sample if len(t) >= n)
    return sum(c - 1 for c in counts.values()) * n


def choose_prefix_length(sample: Sequence[Any], min_tokens: int) -> int:
    """The prefix length that saves the most prompt tokens of ``sample`` (module doc); 0: none."""
    longest = max((len(t) for t in sample), default=0)
    if len(sample) < 2 or longest < min_tokens:
        return 0
    powers = [min_tokens * 2**i for i in range(64) if min_tokens * 2**i <= longest]
    saved = {n: saved_tokens(sample, n) for n in powers}
    best = max(powers, key=lambda n: (saved[n], n))
    if not saved[best]:
        return 0
    rows = saved[best] // best  # rows sharing a prefix beyond its first: the longest length keeping them saves most
    low, high = best, min(best * 2, longest + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if saved_tokens(sample, mid) // mid >= rows else (low, mid)
    return low


@dataclass
class PrefixKeys:
    """Per input row, the index of its shared-prefix key (:data:`NO_KEY`: none); ``n_tokens``: the ``N`` used."""

    n_tokens: int
    keys: np.ndarray  # int32 per row
    total_tokens: int = 0  # of every prompt scanned

    @property
    def n_keys(self) -> int:
        """How many distinct shared prefixes."""
        return int(self.keys.max(initial=NO_KEY)) + 1

    def share(self) -> float:
        """The fraction of rows holding a shared prefix."""
        return float((self.keys != NO_KEY).mean()) if self.keys.size else 0.0

    def saving(self) -> float:
        """The share of all prompt tokens an engine need not compute if each shared prefix were computed once:
        ``sum over keys of (rows - 1) * n_tokens / total_tokens``."""
        shared_rows = int((self.keys != NO_KEY).sum())
        return (shared_rows - self.n_keys) * self.n_tokens / max(1, self.total_tokens)

    def summary(self) -> dict[str, float | int]:
        """``n_tokens``, ``n_keys``, ``share`` and ``saving``, for the store's attrs and logs."""
        rounded = {"share": round(self.share(), 4), "saving": round(self.saving(), 4)}
        return {"n_tokens": self.n_tokens, "n_keys": self.n_keys, **rounded}

    def worth_it(self) -> bool:
        """Whether ``dispatch: auto`` routes by prefix: at least ``daskgen.prefix.min-saving`` of the prompt
        tokens are in shared prefixes (:meth:`saving`)."""
        return self.n_keys > 0 and self.saving() >= float(tunables.get("prefix.min-saving"))


class PrefixScan:
    """Feed every prompt's token ids in input order (:meth:`add`); :meth:`result` gives the keys."""

    def __init__(self, n_tokens: int | None = None) -> None:
        self.sample_rows = int(tunables.get("prefix.sample-rows"))
        self.n_tokens = n_tokens  # None: chosen from the sample
        self.sample: list[np.ndarray] = []
        self.total_tokens = 0
        self.hashes = array("q")  # per row fed: its prefix hash, 0 when shorter than ``n_tokens``

    def add(self, tokens: Any) -> None:
        """One prompt's token ids (the next row)."""
        self.total_tokens += len(tokens)
        if self.n_tokens is not None:
            self._hash(tokens)
            return
        self.sample.append(np.asarray(tokens, dtype=np.int64))
        if len(self.sample) >= self.sample_rows:
            self._choose()

    def _hash(self, tokens: Any) -> None:
        n = self.n_tokens or 0
        self.hashes.append(prefix_hash(tokens, n) if n and len(tokens) >= n else 0)

    def _choose(self) -> None:
        sample, self.sample = self.sample, []
        self.n_tokens = choose_prefix_length(sample, int(tunables.get("prefix.min-tokens")))
        for tokens in sample:
            self._hash(tokens)

    def result(self) -> PrefixKeys:
        """The keys of every row fed (keys held by one row only are dropped)."""
        if self.n_tokens is None:
            self._choose()
        counts = Counter(self.hashes)
        index: dict[int, int] = {}
        keys = np.full(len(self.hashes), NO_KEY, dtype=np.int32)
        for row, h in enumerate(self.hashes):
            if h and counts[h] > 1:
                keys[row] = index.setdefault(h, len(index))
        return PrefixKeys(int(self.n_tokens or 0), keys, self.total_tokens)
