"""A real engine's prefix-cache report, as a run stores it: two prompts sharing a long prefix, one after the other,
their results made trajectories and placed in a store region (as a worker does), read back per sample."""

from __future__ import annotations

from typing import Any

from daskgen.agents import Trajectory
from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.store.layout import Layout, empty_region
from daskgen.worker.samples.region import place_samples

PREFIX_TOKENS = 300


def stored_cached_prompt_tokens(suite: Any) -> list[int]:
    """``cached_prompt_tokens`` of each of two samples whose prompts share a ``PREFIX_TOKENS``-token prefix, sent
    to the conformance ``suite``'s running engine the second after the first finished."""
    prefix = suite.prompt(4242, length=PREFIX_TOKENS)  # an index no other check of the suite uses
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    samples = []
    for i in range(2):
        request = GenerationRequest(f"cached-{i}", prefix + suite.prompt(i, length=6), params)
        result = suite.run(suite.engine.generate(request))
        assert result.error is None, result.error
        trajectory = Trajectory.for_params(params)
        trajectory.add_model_tokens(result)
        samples.append([trajectory])
    layout = Layout(2, 1, PREFIX_TOKENS + 6, 2, 2, 0)
    region = empty_region(layout, 2)
    place_samples(region, [0, 1], [0, 1], 1, samples, layout)
    return [int(v) for v in region["cached_prompt_tokens"][:, 0]]
