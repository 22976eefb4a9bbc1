"""The engine contract: token ids in, token ids out.

An engine is created once per Dask worker by :class:`daskgen.plugin.EnginePlugin` and
driven from the worker's event loop.  All methods are ``async``; engines that wrap a
blocking backend run it in their own thread.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(enum.IntEnum):
    """Why a sample ended; stored as ``int8`` codes in ``finish_reason``."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3


#: CF ``flag_values``/``flag_meanings`` for the stored ``finish_reason`` array.
FINISH_FLAG_VALUES = [int(r) for r in FinishReason]
FINISH_FLAG_MEANINGS = " ".join(r.name.lower() for r in FinishReason)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (all engines interpret them the same way).

    ``temperature == 0`` means greedy decoding.  ``seed`` makes sampling reproducible where
    the engine supports it.  ``logprobs`` asks for the log-probability of each sampled token
    under the model's distribution (before temperature/top-p).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate: prompt token ids plus sampling params."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class GenerationResult:
    """What an engine returns for one request."""

    request_id: str
    output_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """Abstract inference engine.

    Parameters
    ----------
    model:
        Model path or name understood by the backend.
    **engine_args:
        Backend options; an engine raises :class:`daskgen.errors.ConfigError` for keys it
        does not know, listing the valid ones.
    """

    #: Name under which the engine is registered in the ``daskgen.engines`` group.
    name: str = ""
    #: True when stores produced by the engine are not real model output (simulations).
    simulated: bool = False
    #: True when ``SamplingParams.seed`` makes outputs reproducible.
    supports_seed: bool = False

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.model = model
        self.engine_args = engine_args

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; called once per worker, off the worker's event loop thread."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample.  Per-request failures come back as ``error``, not raised."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request in flight; its ``generate`` returns with ``FinishReason.ABORT``."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release the model and any processes or threads the engine started."""

    async def health(self) -> None:
        """Raise unless the engine can really generate (generates one token)."""
        result = await self.generate(
            GenerationRequest("daskgen-health", [self.health_token_id()], SamplingParams(max_new_tokens=1, temperature=0.0))
        )
        if result.error is not None or len(result.output_ids) != 1:
            from daskgen.errors import EngineError

            raise EngineError(f"engine {self.name!r} failed its health check: {result.error or result.output_ids!r}")

    def health_token_id(self) -> int:
        """A token id that is valid for the model (used by :meth:`health`)."""
        return 1

    async def sleep(self) -> None:  # noqa: B027 - optional hook
        """Release accelerator memory while idle, where the backend supports it."""

    async def wake(self) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`sleep`."""

    def describe(self) -> dict[str, Any]:
        """Identity recorded in the store attrs (no secrets)."""
        return {"engine": self.name, "simulated": self.simulated}
