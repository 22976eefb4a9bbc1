"""Continuing what an interrupted attempt stored: the samples of pending rows to keep, and one sample
generated on from its stored aborted prefix, token-exact."""

from __future__ import annotations

from collections.abc import Awaitable

import numpy as np

from daskgen.agents import AgentLoop, EngineHandle, Trajectory
from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.engines.continuation import continuation_of
from daskgen.worker.samples.top_logprobs import stored_top_logprobs


def stored_samples(
    region: dict[str, np.ndarray], start: int, rows: list[int], n_samples: int, stops: set[int], logprobs: bool
) -> dict[tuple[int, int], Trajectory]:
    """Stored samples of the pending ``rows`` (store rows; the region starts at ``start``) to keep: finished
    ones as they are, aborted ones as prefixes.

    An aborted prefix that already ends with a stop token is finished (``stop``), not continued.
    """
    out = {}
    for row in rows:
        for s in range(n_samples):
            stored = _stored_sample(region, row - start, s, stops, logprobs)
            if stored is not None:
                out[row, s] = stored
    return out


def _stored_sample(region: dict[str, np.ndarray], r: int, s: int, stops: set[int], logprobs: bool) -> Trajectory | None:
    """Sample ``s`` of region row ``r`` as stored, or ``None`` when it was never generated (or failed)."""
    reason = int(region["finish_reason"][r, s])
    if reason not in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
        return None
    n = int(region["response_length"][r, s])
    ids = region["response_ids"][r, s, :n].tolist()
    if reason == FinishReason.ABORT and ids and ids[-1] in stops:
        reason = FinishReason.STOP
    return Trajectory(
        ids,
        region["response_mask"][r, s, :n].tolist(),
        region["logprobs"][r, s, :n].tolist() if logprobs else None,
        FinishReason(reason),
        int(region["num_turns"][r, s]),
        continued=int(region["continued_tokens"][r, s]) if "continued_tokens" in region else 0,
        carried=n,
        stop_reason=int(region["stop_reason"][r, s]) if "stop_reason" in region else -1,
        top_logprobs=stored_top_logprobs(region, (r, s), n),
        versions=stored_versions(region, (r, s)),
        fingerprints=stored_fingerprints(region, (r, s)),
    )


def stored_versions(region: dict[str, np.ndarray], index: tuple[int, int]) -> list[tuple[int, int]]:
    """The ``(position, version)`` segments a stored sample records (first token's, and where it changed)."""
    if "policy_version" not in region or int(region["policy_version"][index]) < 0:
        return []
    first, changed = int(region["policy_version"][index]), int(region["version_changed_at"][index])
    end = int(region["policy_version_end"][index])
    return [(0, first)] if changed < 0 else [(0, first), (changed, end)]


def stored_fingerprints(region: dict[str, np.ndarray], index: tuple[int, int]) -> dict[int, int]:
    """The checked fingerprints a stored sample records, by version (empty: none stored)."""
    if "policy_fingerprint" not in region or int(region["policy_version"][index]) < 0:
        return {}
    return {
        int(region["policy_version"][index]): int(region["policy_fingerprint"][index]),
        int(region["policy_version_end"][index]): int(region["policy_fingerprint_end"][index]),
    }


def sample_with_prefix(
    agent: AgentLoop,
    handle: EngineHandle,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    prefix: Trajectory | None,
) -> Awaitable[list[Trajectory]]:
    """One sample through the agent loop, continuing a stored aborted prefix when given.

    The continuation is token-exact: the stored ids (and logprobs) followed by what the engine
    generates after ``prompt + prefix``, with the remaining token budget.  Without a prefix it is the agent
    loop's own coroutine (no wrapper: this runs once per sample).
    """
    if prefix is None:
        return agent.run(handle, request_id, prompt, params)
    return _stored_or_continued(agent, handle, request_id, prompt, params, prefix)


async def _stored_or_continued(
    agent: AgentLoop,
    handle: EngineHandle,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    prefix: Trajectory,
) -> list[Trajectory]:
    """A stored sample as it is, or its aborted ``prefix`` continued as
    :func:`~daskgen.engines.continuation.continuation_of` says: finished as it is (no tokens left), generated again
    from its prompt, or its prompt and tokens so far with what is left."""
    if prefix.finish_reason != FinishReason.ABORT:
        return [prefix]
    request = GenerationRequest(request_id, prompt, params)
    partial = GenerationResult(request_id, prefix.response_ids, FinishReason.ABORT)
    rest = continuation_of(request, partial, frozenset(), handle.engine.continues)  # stop tokens: stored_samples
    if rest is None:
        prefix.finish_reason = partial.finish_reason
        return [prefix]
    if rest is request:
        return await agent.run(handle, request_id, prompt, params)
    (tail,) = await agent.run(handle, request_id, rest.prompt_ids, rest.params)
    return [_joined(prefix, tail)]


def _joined(prefix: Trajectory, tail: Trajectory) -> Trajectory:
    """``prefix`` followed by its continuation ``tail``: one trajectory that counts the prefix as carried over."""
    return Trajectory(
        prefix.response_ids + tail.response_ids,
        prefix.response_mask + tail.response_mask,
        None if prefix.logprobs is None else prefix.logprobs + (tail.logprobs or []),
        tail.finish_reason,
        max(prefix.num_turns, tail.num_turns),
        tail.error,
        continued=len(prefix.response_ids),
        carried=len(prefix.response_ids),
        stop_reason=tail.stop_reason,
        top_logprobs=None if prefix.top_logprobs is None else prefix.top_logprobs + (tail.top_logprobs or []),
        versions=_joined_versions(prefix, tail),
    )


def _joined_versions(prefix: Trajectory, tail: Trajectory) -> list[tuple[int, int]]:
    """The version segments of ``prefix`` followed by ``tail``'s (shifted past the prefix)."""
    joined = Trajectory(versions=list(prefix.versions))
    joined.add_versions(tail.versions, len(prefix.response_ids), len(tail.response_ids))
    return joined.versions
