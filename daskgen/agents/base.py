"""Agent-loop interface: how one (prompt, sample) becomes one or more trajectories.

A loop receives the prompt's token ids, the sampling params and an :class:`EngineHandle`, and
returns trajectories.  ``single_turn`` (one engine call) is the default; ``tool`` runs a
multi-turn tool-calling loop (:mod:`daskgen.agents.tool`); users plug in their own class by
import path (``package.module:Class``).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from daskgen.engines.base import (
    BASE_POLICY_VERSION,
    Engine,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TopLogprobs,
)
from daskgen.engines.batch import Finished, each_as_finished
from daskgen.engines.media import ImageInput
from daskgen.errors import EngineError


@dataclass
class Trajectory:
    """Token-exact record of one trajectory.

    ``response_ids`` hold model tokens and tool/observation tokens in order; ``response_mask``
    is 1 exactly for model tokens; ``logprobs`` (when requested) has one entry per response
    token, NaN for non-model tokens; ``top_logprobs`` (when requested) likewise, an empty list for
    non-model tokens.
    """

    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: FinishReason = FinishReason.STOP
    num_turns: int = 0
    error: str | None = None
    #: Leading response tokens that an interrupted earlier attempt generated (continued, not regenerated).
    continued: int = 0
    #: Tokens of this trajectory taken from the store rather than generated now (accounting only).
    carried: int = 0
    #: Which stop ended it (:mod:`daskgen.engines.stops`), set by the worker in runs with stops.
    stop_reason: int = -1
    top_logprobs: TopLogprobs | None = None
    #: ``(response position, policy version)`` where each run of model tokens from one policy version starts.
    versions: list[tuple[int, int]] = field(default_factory=list)
    #: The fingerprint (:func:`daskgen.store.fingerprint.digest_number`) of each policy version in ``versions``
    #: whose loaded weights the worker checked against the published fingerprint; 0 or absent: unchecked.
    fingerprints: dict[int, int] = field(default_factory=dict)
    #: Prompt tokens the engine served from its prefix cache, summed over the turns (-1: the engine does not say).
    cached_prompt_tokens: int = -1
    #: Images its tools returned, in order, each ``span`` its placeholder tokens' (offset, length) in ``response_ids``.
    images: list[ImageInput] = field(default_factory=list)

    @property
    def policy_version(self) -> int:
        """The policy version of the first model token (-1: no model token)."""
        return self.versions[0][1] if self.versions else -1

    @property
    def policy_version_end(self) -> int:
        """The policy version of the last model token (-1: no model token)."""
        return self.versions[-1][1] if self.versions else -1

    @property
    def version_changed_at(self) -> int:
        """The response position of the first token from another version than the first token's (-1: none)."""
        return self.versions[1][0] if len(self.versions) > 1 else -1

    def add_versions(self, segments: list[tuple[int, int]], offset: int, n: int) -> None:
        """Record ``(position, version)`` segments of ``n`` tokens placed at response position ``offset``."""
        for position, version in segments:
            if position < n and (not self.versions or self.versions[-1][1] != version):
                self.versions.append((offset + position, version))

    @classmethod
    def for_params(cls, params: SamplingParams) -> Trajectory:
        """An empty trajectory recording what ``params`` ask for (logprobs, top-k logprobs)."""
        return cls(logprobs=[] if params.logprobs else None, top_logprobs=[] if params.top_logprobs else None)

    @classmethod
    def of_turn(cls, params: SamplingParams, result: GenerationResult) -> Trajectory:
        """The trajectory of one engine call (``result``) made with ``params``."""
        trajectory = cls.for_params(params)
        trajectory.add_model_tokens(result)
        return trajectory

    def add_model_tokens(self, result: GenerationResult) -> None:
        """Append one engine result as model tokens (and the policy versions that generated them)."""
        n, offset = len(result.output_ids), len(self.response_ids)
        segments = result.meta.get("policy_versions") or [(0, BASE_POLICY_VERSION)]
        self.add_versions(segments, offset, n)
        if fingerprints := result.meta.get("policy_fingerprints"):
            self.fingerprints.update(fingerprints)
        self.response_ids += result.output_ids
        self.response_mask += [1] * n
        if (cached := result.meta.get("cached_tokens")) is not None:
            self.cached_prompt_tokens = max(self.cached_prompt_tokens, 0) + int(cached)
        if (given := result.logprobs) is not None:
            self.logprobs = self.logprobs or [math.nan] * offset
            self.logprobs += given if len(given) <= n else given[:n]
            if len(given) < n:
                self.logprobs += [math.nan] * (n - len(given))
        elif self.logprobs is not None:
            self.logprobs += [math.nan] * n
        self._add_top_logprobs(result)
        self.num_turns += 1
        self.finish_reason = result.finish_reason
        if result.error is not None:
            self.error, self.finish_reason = result.error, FinishReason.ERROR

    def add_observation_tokens(self, ids: list[int]) -> None:
        """Append tool/observation tokens (mask 0, no logprobs)."""
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        if self.logprobs is not None:
            self.logprobs += [math.nan] * len(ids)
        if self.top_logprobs is not None:
            self.top_logprobs += [[] for _ in ids]

    def _add_top_logprobs(self, result: GenerationResult) -> None:
        """Append ``result``'s top-k entries, one per output token (empty where it returned none)."""
        n, top = len(result.output_ids), result.top_logprobs
        if top is None and self.top_logprobs is None:
            return
        if self.top_logprobs is None:
            self.top_logprobs = [[] for _ in range(len(self.response_ids) - n)]
        given = list(top[:n]) if top is not None else []
        self.top_logprobs += given + [[] for _ in range(n - len(given))]


class PolicyGate(Protocol):
    """What runs a request when the run refreshes its policy (:class:`daskgen.worker.refresh.PolicyRefresher`):
    admits it at the current version and stamps the result's ``meta["policy_versions"]``."""

    async def generate(
        self, engine: Engine, request: GenerationRequest, stopped: Callable[[], bool]
    ) -> GenerationResult: ...


class ToolMedia(Protocol):
    """What a tool loop uses to place the images its tools return (the worker's
    :class:`daskgen.worker.tool_images.ToolImages`): the model's image placeholder token, and each image read, kept
    in the store and preprocessed."""

    image_token: int

    async def prepare(self, source: Any) -> ImageInput:
        """The image ``source`` (a URL, the image file's bytes or a Pillow image), its ``span`` ``(0, tokens)``."""
        ...


class EngineHandle:
    """What a loop sees of the engine: ``generate`` with in-flight tracking, so a hung partition
    can abort every request of its loops.

    ``live`` (the worker's :meth:`~daskgen.worker.plugin.EnginePlugin.live_engine`) tells whether the engine
    a request went to is still the worker's running engine.  A request that errors or raises because
    its engine was shut down for a restart meanwhile (a crash caused by another request) ends
    ``abort`` — its row is requeued — instead of failing its row as a bad request would.  A request that
    errors because the backend of the running engine died (:meth:`~daskgen.engines.base.Engine.died`,
    e.g. vLLM's ``EngineCore`` process was killed) raises :class:`~daskgen.errors.EngineError`: its
    partition fails, the worker restarts the engine and Dask retries the partition.  ``policy`` (the worker's
    :class:`~daskgen.worker.refresh.PolicyRefresher` in runs with ``refresh``) runs each request: it waits while a
    policy refresh loads and stamps the result with its tokens' policy versions.  ``media`` (a :class:`ToolMedia`,
    in runs whose tool loop places images its tools return) prepares those images.
    """

    def __init__(
        self, engine: Engine, live: Callable[[], Engine | None] | None = None, policy: PolicyGate | None = None
    ) -> None:
        self.engine = engine
        self.live = live
        self.policy = policy
        self.in_flight: set[str] = set()
        self.stopped = False
        self.media: ToolMedia | None = None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate one turn (after :meth:`abort_all`, returns ``abort`` without calling the engine)."""
        if self.stopped:
            return _aborted(request_id, params)
        engine = self.engine
        self.in_flight.add(request_id)
        try:
            request = GenerationRequest(request_id, list(prompt_ids), params)
            if self.policy is not None:
                result = await self.policy.generate(engine, request, lambda: self.stopped)
            else:
                result = await engine.generate(request)
        except Exception:
            if self._replaced(engine):
                return _aborted(request_id, params)
            raise
        finally:
            self.in_flight.discard(request_id)
        return self._checked(engine, request, result)

    async def generate_batch(self, requests: Sequence[GenerationRequest]) -> AsyncGenerator[Finished, None]:
        """One turn of every request at once: ``(index, result)`` groups as they finish, each result what
        :meth:`generate` would return for it (:meth:`~daskgen.engines.base.Engine.generate_batch`)."""
        if self.stopped:
            yield [(i, _aborted(r.request_id, r.params)) for i, r in enumerate(requests)]
            return
        if self.policy is not None:  # the policy gate admits each request on its own
            async for group in each_as_finished(
                lambda r: self.generate(r.request_id, r.prompt_ids, r.params), requests
            ):
                yield group
            return
        engine, left = self.engine, dict(enumerate(requests))
        self.in_flight.update(r.request_id for r in requests)
        try:
            async with contextlib.aclosing(engine.generate_batch(requests)) as groups:
                async for group in groups:
                    for i, _ in group:
                        self.in_flight.discard(left.pop(i).request_id)
                    yield [(i, self._checked(engine, requests[i], result)) for i, result in group]
        except Exception:
            if not self._replaced(engine):
                raise
            yield [(i, _aborted(r.request_id, r.params)) for i, r in left.items()]
        finally:
            self.in_flight.difference_update(r.request_id for r in left.values())

    def _one(self, request: GenerationRequest) -> Awaitable[GenerationResult]:
        return self.generate(request.request_id, request.prompt_ids, request.params)

    def _checked(self, engine: Engine, request: GenerationRequest, result: GenerationResult) -> GenerationResult:
        """``result`` of ``request``: ``abort`` when it failed because its engine was replaced; raises
        :class:`~daskgen.errors.EngineError` when it failed because the running engine's backend died."""
        if result.finish_reason != FinishReason.ERROR:
            return result
        if self._replaced(engine):
            return _aborted(request.request_id, request.params)
        if (death := engine.died()) is not None:
            raise EngineError(f"{engine.name} engine died while request {request.request_id!r} ran: {death}")
        return result

    def _replaced(self, engine: Engine) -> bool:
        """True when ``engine`` is no longer the worker's running engine (shut down for a restart)."""
        return self.live is not None and self.live() is not engine

    async def abort_all(self) -> None:
        """Abort every request still in flight; later turns are not started."""
        self.stopped = True
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)


def _aborted(request_id: str, params: SamplingParams) -> GenerationResult:
    top: TopLogprobs | None = [] if params.top_logprobs else None
    return GenerationResult(request_id, [], FinishReason.ABORT, [] if params.logprobs else None, top_logprobs=top)


class AgentLoop(abc.ABC):
    """Turns one (prompt, sample) into trajectories.

    Parameters
    ----------
    model:
        The run's model path (loops that render chat templates load its tokenizer).
    **agent_args:
        Loop options from the run config's ``agent_args``.
    """

    #: Most trajectories one sample may produce (sizes the store's ``trajectory`` axis).
    max_trajectories: int = 1

    def __init__(self, model: str, **agent_args: Any) -> None:
        self.model = model
        self.agent_args = agent_args

    @abc.abstractmethod
    async def run(
        self, engine: EngineHandle, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[Trajectory]:
        """Produce at least one trajectory; per-request failures go into ``Trajectory.error``."""


class SingleTurn(AgentLoop):
    """One engine call per sample: today's plain generation."""

    def __init__(self, model: str, **agent_args: Any) -> None:
        if agent_args:
            from daskgen.errors import ConfigError

            raise ConfigError(f"agent 'single_turn' takes no agent_args, found {sorted(agent_args)}")
        super().__init__(model)

    async def run(
        self, engine: EngineHandle, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[Trajectory]:
        return [Trajectory.of_turn(params, await engine.generate(request_id, prompt_ids, params))]
