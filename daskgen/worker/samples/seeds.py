"""Per-sample seeds of a whole partition at once, and sampling params that differ only in their seed.

:func:`~daskgen.worker.samples.row_sampling.sample_seed` derives one sample's seed from ``(run seed, row, sample)``
through ``numpy.random.SeedSequence``; constructing one costs about 10-20 µs.  :func:`sample_seeds` computes
the very same numbers for every sample of a partition with a handful of array operations: it runs
``SeedSequence``'s entropy mixing (a fixed sequence of 32-bit hash steps, the same for every input of three
words) on arrays.  Inputs outside that case (a seed, row or sample of 2**32 or more, or negative) take the
scalar path, so the result is always ``sample_seed``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from daskgen.engines.base import SamplingParams

__all__ = ["sample_seeds", "with_seed"]

# numpy's SeedSequence constants (numpy/random/bit_generator.pyx)
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16
_POOL = 4
_MASK = 0xFFFFFFFF


def _hash_consts() -> list[int]:
    """The successive hash constants ``hashmix`` uses while mixing a 4-word pool (independent of the data)."""
    consts, h = [], _INIT_A
    for _ in range(_POOL + _POOL * (_POOL - 1)):
        consts.append(h)
        h = (h * _MULT_A) & _MASK
    return consts


_CONSTS = _hash_consts()


def _hashmix(value: np.ndarray, const: int) -> np.ndarray:
    value = value ^ np.uint32(const)
    value = value * np.uint32((const * _MULT_A) & _MASK)
    return value ^ (value >> np.uint32(_XSHIFT))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
    return result ^ (result >> np.uint32(_XSHIFT))


def _first_words(words: list[np.ndarray]) -> np.ndarray:
    """``SeedSequence(words).generate_state(1, uint32)[0]`` for each column of three 32-bit ``words``."""
    consts = iter(_CONSTS)
    zero = np.zeros_like(words[0])
    pool = [_hashmix(words[i] if i < len(words) else zero, next(consts)) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], next(consts)))
    value = pool[0] ^ np.uint32(_INIT_B)
    value = value * np.uint32((_INIT_B * _MULT_B) & _MASK)
    return value ^ (value >> np.uint32(_XSHIFT))


def sample_seeds(seed: int, rows: Sequence[int], n_samples: int) -> list[int]:
    """``sample_seed(seed, row, s)`` for every row and sample, row-major (``rows[0]``'s samples first)."""
    from daskgen.worker.samples.row_sampling import sample_seed

    if not rows or n_samples < 1:
        return []
    row_array = np.asarray(rows, dtype=np.int64)
    if not (0 <= seed <= _MASK and row_array.min() >= 0 and row_array.max() <= _MASK):
        return [sample_seed(seed, int(r), s) for r in rows for s in range(n_samples)]
    columns = np.repeat(row_array, n_samples).astype(np.uint32)
    samples = np.tile(np.arange(n_samples, dtype=np.uint32), len(rows))
    seeds = np.full(len(columns), seed, dtype=np.uint32)
    return (_first_words([seeds, columns, samples]) & np.uint32(0x7FFFFFFF)).tolist()


def with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    """``dataclasses.replace(params, seed=seed)`` without re-running the dataclass constructor (a copy of its
    fields with the seed set: the frozen params are otherwise shared)."""
    out = object.__new__(SamplingParams)
    out.__dict__.update(params.__dict__)
    out.__dict__["seed"] = seed
    return out
