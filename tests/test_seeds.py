"""Per-sample seeds computed for a whole partition at once are the per-sample derivation's, and the seeded
params are ``dataclasses.replace``'s."""

import dataclasses
import random

from daskgen.engines.base import SamplingParams
from daskgen.worker.samples.row_sampling import sample_seed
from daskgen.worker.samples.seeds import sample_seeds, with_seed


def test_partition_seeds_equal_the_per_sample_derivation():
    rnd = random.Random(7)
    cases = [(0, [0], 1), (2**32 - 1, [2**32 - 1, 0], 3), (2**32, [5], 2), (3, [2**40, 1], 2), (1, [], 4)]
    cases += [(rnd.randrange(2**32), [rnd.randrange(10**7) for _ in range(5)], rnd.randrange(1, 5)) for _ in range(50)]
    for seed, rows, n in cases:
        assert sample_seeds(seed, rows, n) == [sample_seed(seed, r, s) for r in rows for s in range(n)], (seed, rows, n)


def test_with_seed_is_a_replace_that_leaves_the_original_alone():
    base = SamplingParams(max_new_tokens=9, temperature=0.5, logprobs=True, stop_token_ids=(2, 3))
    seeded = with_seed(base, 12345)
    assert seeded == dataclasses.replace(base, seed=12345)
    assert hash(seeded) == hash(dataclasses.replace(base, seed=12345))
    assert base.seed is None and seeded is not base
