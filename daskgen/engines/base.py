"""The engine contract: token ids in, token ids out.

An engine is created once per Dask worker by :class:`daskgen.worker.plugin.EnginePlugin` and driven from the
worker's event loop.  All methods are ``async``; engines that wrap a blocking backend run it in their own thread.

Lifecycle (one for every engine): :attr:`Engine.status` is an :class:`EngineStatus`.  :meth:`Engine.start` runs
once (``NEW`` -> ``STARTING`` -> ``RUNNING``, or ``FAILED`` after releasing what the failed start acquired);
:meth:`Engine.shutdown` runs once and may be called in any state (-> ``CLOSED``).  An engine implements the two
hooks :meth:`Engine.load` and :meth:`Engine.unload`; callers only ever call ``start``/``shutdown``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from daskgen.declare import off_values
from daskgen.errors import EngineError, RefreshError
from daskgen.run_options import RunOptions

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Sequence

    from daskgen.engines.batch import Finished
    from daskgen.engines.media import ImageInput
    from daskgen.input.response_format import ResponseFormat

_T = TypeVar("_T")

#: The policy version of the weights an engine starts with (the run's ``model``); published versions start at 1.
BASE_POLICY_VERSION = 0


class FinishReason(enum.IntEnum):
    """Why a sample ended; stored as ``int8`` codes in ``finish_reason``."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    @property
    def label(self) -> str:
        """The reason's name in the store's CF attributes, exports, followed batches and the dashboard (``stop``,
        ``length``, ``abort``, ``error``)."""
        return self.name.lower()


class EngineStatus(enum.Enum):
    """Where an engine is in its lifecycle (see the module docstring)."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    #: :meth:`Engine.start` raised; the engine cannot be started again.
    FAILED = "failed"
    #: The backend died while running (requests fail, :meth:`Engine.health` raises).
    CRASHED = "crashed"
    CLOSED = "closed"


#: CF ``flag_values``/``flag_meanings`` for the stored ``finish_reason`` array.
FINISH_FLAG_VALUES = [int(r) for r in FinishReason]
FINISH_FLAG_MEANINGS = " ".join(r.label for r in FinishReason)

#: Finish-reason names the backends report (sglang's ``meta_info.finish_reason.type``, vLLM's
#: ``finish_reason``, OpenAI-compatible servers' ``finish_reason``) and daskgen's reasons.
BACKEND_FINISH_NAMES: dict[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "eos": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


def finish_from_name(name: Any, source: str) -> tuple[FinishReason, str | None]:
    """``(reason, error)`` for a backend's finish-reason ``name``: a name outside :data:`BACKEND_FINISH_NAMES` (``None``
    included) is ``ERROR`` with the message ``f"{source} finished with {name!r}"``; a known one has no error."""
    reason = BACKEND_FINISH_NAMES.get(name, FinishReason.ERROR) if isinstance(name, str) else FinishReason.ERROR
    return reason, None if reason != FinishReason.ERROR else f"{source} finished with {name!r}"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (all engines interpret them the same way).

    ``temperature == 0`` means greedy decoding.  ``seed`` makes sampling reproducible where
    the engine supports it.  ``logprobs`` asks for the log-probability of each sampled token
    under the model's distribution (before temperature/top-p).  ``stop`` strings and
    ``stop_token_ids`` end a sample (``STOP``); the response keeps every token up to and including
    the one that completed the stop (stop text and stop token are in the output, the same on
    every engine: :mod:`daskgen.engines.stops`).  ``min_p``, ``min_new_tokens`` and the penalties
    (``repetition_penalty`` on prompt and output tokens, ``presence_penalty``/``frequency_penalty`` on
    output tokens) mean what they mean in vLLM and SGLang; their defaults are off.  ``response_format``
    constrains the response (:mod:`daskgen.input.response_format`; engines that serve it map it to their own
    fields).  ``top_logprobs = k > 0`` asks, per
    output token, for the ``k`` most likely tokens of the logprobs' distribution (:data:`TopLogprobs`).
    ``adapter`` names the LoRA adapter to generate with (one of the ``adapters`` the engine was built with;
    ``None``: the base model).  ``continued = n > 0`` marks a continuation of an interrupted sample: the last ``n``
    prompt ids are the sample's own tokens so far, and ``max_new_tokens``/``min_new_tokens`` count what is left
    (:mod:`daskgen.engines.continuation`).  ``images`` are the request's images, placed in the prompt ids
    (:class:`~daskgen.engines.media.ImageInput`).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    min_p: float = 0.0
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    response_format: ResponseFormat | None = None
    top_logprobs: int = 0
    adapter: str | None = None
    continued: int = 0
    images: tuple[ImageInput, ...] = ()


#: Per output token, the ``k`` most likely ``(token_id, logprob)`` pairs, most likely first (fewer
#: where the engine returned fewer, none for tokens the model did not generate).
TopLogprobs = list[list[tuple[int, float]]]


#: The :class:`SamplingParams` fields with an off value (``option(off=...)`` in :mod:`daskgen.run_options`), with
#: it: vLLM and SGLang take them under the same name (or one a backend's mapping renames).
SHAPING_OFF: dict[str, Any] = off_values(RunOptions)


def shaping_kwargs(params: SamplingParams, renamed: dict[str, str]) -> dict[str, Any]:
    """The fields of :data:`SHAPING_OFF` that ``params`` turn on, named as a backend names them (``renamed``)."""
    return {renamed.get(k, k): getattr(params, k) for k, off in SHAPING_OFF.items() if getattr(params, k) != off}


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
    top_logprobs: TopLogprobs | None = None


def error_result(request: GenerationRequest, message: str) -> GenerationResult:
    """The result of a request that failed before (or instead of) generating."""
    return GenerationResult(request.request_id, [], FinishReason.ERROR, None, error=message)


def aborted_result(request: GenerationRequest) -> GenerationResult:
    """The result of a request aborted before it produced a token (empty logprobs when asked)."""
    top: TopLogprobs | None = [] if request.params.top_logprobs else None
    return GenerationResult(
        request.request_id, [], FinishReason.ABORT, [] if request.params.logprobs else None, top_logprobs=top
    )


def set_result(future: asyncio.Future, result: Any) -> None:
    """Resolve ``future`` with ``result`` unless it is done; callable from any thread.

    On the future's own (running) loop it is set at once; from elsewhere it is scheduled on that
    loop, and dropped when the loop is closed (nobody waits any more).
    """
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        if not future.done():
            future.set_result(result)
        return

    def settle() -> None:
        if not future.done():
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)


def started(engine: str, part: _T | None) -> _T:
    """``part`` (a backend object the engine sets when it starts); ``EngineError`` while it is ``None``."""
    if part is None:
        raise EngineError(f"{engine} engine not started")
    return part


class Engine(abc.ABC):
    """Abstract inference engine.

    Parameters
    ----------
    model:
        Model path or name understood by the backend.
    **engine_args:
        Backend options; :class:`daskgen.errors.ConfigError` for unknown keys, listing the valid ones.
    """

    # Capabilities with their defaults: overridden as class attributes, or properties when known only after start;
    # callers never use getattr fallbacks.  name and simulated are read on the class too (registry, is_simulated).

    #: Name under which the engine is registered in the ``daskgen.engines`` group.
    name: str = ""
    #: True when stores produced by the engine are not real model output (simulations).
    simulated: bool = False
    #: Request features served (:data:`daskgen.engines.features.FEATURES`); the plan refuses others.  Read on the class.
    features: frozenset[str] = frozenset()
    #: Features whose state a sample's tokens so far carry that the engine continues exactly (names of
    #: :data:`daskgen.engines.continuation.CONTINUABLE`); a sample using another restarts from its prompt.
    continues: frozenset[str] = frozenset()
    #: Features served only when an engine arg has a value: ``{feature: ((engine arg, value), ...)}`` (one enough).
    features_by_arg: dict[str, tuple[tuple[str, Any], ...]] = {}
    #: Sampling values the engine refuses per request that the table allows (``{key: Range}``): refused at plan time.
    sampling_ranges: dict[str, Any] = {}

    @classmethod
    def features_with(cls, engine_args: dict[str, Any]) -> frozenset[str]:
        """The features an engine built with ``engine_args`` serves: :attr:`features`, and those of
        :attr:`features_by_arg` one of whose engine args has its value.  Read on the class by the plan."""
        by_arg = {name for name, pairs in cls.features_by_arg.items() if any(engine_args.get(a) == v for a, v in pairs)}
        return (cls.features | by_arg) - cls.refused_features(engine_args).keys()

    @classmethod
    def refused_features(cls, engine_args: dict[str, Any]) -> dict[str, str]:
        """Declared features an engine built with ``engine_args`` cannot serve on this machine, each with the reason
        (the plan refuses a run asking for one, giving it); none by default.  Read on the class."""
        return {}

    @classmethod
    def ranges_with(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        """:attr:`sampling_ranges` of an engine built with ``engine_args`` (read on the class, by the plan)."""
        return cls.sampling_ranges

    @classmethod
    def top_logprobs_limit(cls, engine_args: dict[str, Any]) -> tuple[int, str] | None:
        """The most top-k logprobs one request may ask for with ``engine_args``, and the engine arg that raises it;
        ``None`` when the engine sets no limit.  Read on the class: the plan refuses a larger ``top_logprobs``."""
        return None

    @classmethod
    def prefix_admission(cls, engine_args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The engine args of a run dispatched by prefix, and whether the engine then admits its waiting requests by
        shared prefix itself (its partitions then keep input order: :mod:`daskgen.client.prefix_dispatch`)."""
        return engine_args, False

    @property
    def supports_seed(self) -> bool:
        """True when ``SamplingParams.seed`` makes outputs reproducible."""
        return False

    @property
    def sleep_supported(self) -> bool:
        """True when :meth:`sleep`/:meth:`wake` really release and resume accelerator memory."""
        return False

    @property
    def retokenized(self) -> bool:
        """True when outputs are text re-tokenized by daskgen (not token-exact), e.g. OpenAI protocols."""
        return False

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every request (the model's EOS ids); empty when unknown."""
        return frozenset()

    @property
    def max_total_tokens(self) -> int | None:
        """Largest prompt plus ``max_new_tokens`` of one request; ``None`` when unknown."""
        return None

    @property
    def vocab_size(self) -> int | None:
        """Size of the model's vocabulary (prompt ids must be below it); ``None`` when unknown."""
        return None

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.model = model
        self.engine_args = engine_args
        self.status = EngineStatus.NEW

    # ------------------------------------------------------------------ lifecycle (written once)

    async def start(self) -> None:
        """Start the engine once: :meth:`load`, then ``RUNNING``.

        Called once per worker, off the worker's event loop thread.  A second call raises
        :class:`daskgen.errors.EngineError` (create a new engine instead); when :meth:`load`
        raises, :meth:`unload` releases what it acquired, the status becomes ``FAILED`` and the
        exception propagates.
        """
        if self.status is not EngineStatus.NEW:
            raise EngineError(f"{self.name} engine is {self.status.value}; create a new engine to start again")
        self.status = EngineStatus.STARTING
        try:
            await self.load()
        except BaseException:
            self.status = EngineStatus.FAILED
            await self.unload()
            raise
        if self.status is EngineStatus.STARTING:  # not shut down (or crashed) meanwhile
            self.status = EngineStatus.RUNNING

    async def shutdown(self) -> None:
        """Close the engine once (idempotent, callable in any state): ``CLOSED``, then :meth:`unload`."""
        if self.status is EngineStatus.CLOSED:
            return
        started = self.status is not EngineStatus.NEW
        self.status = EngineStatus.CLOSED
        if started:
            await self.unload()

    async def load(self) -> None:  # noqa: B027 - an engine with nothing to load keeps the default
        """Hook: load the model and start the backend (called by :meth:`start` only)."""

    async def unload(self) -> None:  # noqa: B027 - an engine with nothing to release keeps the default
        """Hook: release the model, processes and threads (after :meth:`shutdown` or a failed :meth:`load`).

        Called at most twice (a failed start, then shutdown): it must cope with a partial or an
        already released backend.
        """

    def crash(self) -> str | None:
        """Hook: what killed the backend while running, or ``None`` while it is alive (or when the engine
        cannot tell)."""
        return None

    def died(self) -> str | None:
        """Why the backend of this started engine died (its :meth:`crash`), or ``None``: alive, never
        started, or shut down.  A request that fails because its engine died is not the request's fault."""
        if self.status not in (EngineStatus.RUNNING, EngineStatus.CRASHED):
            return None
        return self.crash()

    def not_serving(self) -> str | None:
        """Why the engine cannot take requests now, or ``None`` when it can."""
        if self.status is not EngineStatus.RUNNING:
            return f"{self.name} engine is {self.status.value}, not running"
        return None

    # ------------------------------------------------------------------ requests

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample.  Per-request failures come back as ``error``, not raised."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request in flight; its ``generate`` returns with ``FinishReason.ABORT``."""

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> AsyncGenerator[Finished, None]:
        """Generate ``requests`` at once, yielding ``(index, result)`` groups as they finish
        (:mod:`daskgen.engines.batch`); each result is what :meth:`generate` returns.  Default: one
        :meth:`generate` per request."""
        from daskgen.engines.batch import each_as_finished

        return each_as_finished(self.generate, requests)

    @property
    def capacity(self) -> int | None:
        """Requests the engine works on at once (its batch slots), when known after :meth:`start`.

        ``window: auto`` sizes the per-worker in-flight window from it; ``None`` means unknown.
        """
        return None

    async def health(self) -> None:
        """Raise unless the engine is serving (:meth:`not_serving`) and really generates one token."""
        problem = self.not_serving()
        if problem is not None:
            raise EngineError(problem)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        result = await self.generate(GenerationRequest("daskgen-health", [self.health_token_id()], params))
        if result.error is not None or len(result.output_ids) != 1:
            raise EngineError(f"engine {self.name!r} failed its health check: {result.error or result.output_ids!r}")

    def health_token_id(self) -> int:
        """A token id that is valid for the model (used by :meth:`health`)."""
        return 1

    async def update_weights(self, path: str) -> None:
        """Load the weights saved in the folder ``path`` into the running model, in place (no second copy).

        Called by the worker's policy refresher (:mod:`daskgen.worker.refresh`) while no request of the run is in
        the engine.  An engine that serves it declares the ``refresh`` feature; when the load fails the engine must
        still serve its previous weights, or raise :class:`~daskgen.errors.EngineError` to be restarted.  Raises
        :class:`~daskgen.errors.RefreshError` when this engine cannot load new weights in place (the default), or
        the checkpoint does not fit the model.
        """
        raise RefreshError(
            f"engine {self.name!r} cannot load new weights in place; use an engine that serves 'refresh' "
            "(transformers, sglang, vllm, openai with managed=true) or run without `refresh`."
        )

    async def stage_weights(self, path: str) -> Any:
        """Prepare the folder ``path`` for :meth:`apply_staged` while the engine generates; the default returns it."""
        return path

    async def apply_staged(self, staged: Any) -> float | None:
        """Load what :meth:`stage_weights` returned (the default: ``update_weights(staged)``); returns the seconds of
        it spent waiting for the generation step in progress to end, or ``None`` when the engine cannot tell."""
        await self.update_weights(staged)
        return None

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint (:func:`daskgen.engines.fingerprint.tensor_fingerprint`) of each checkpoint tensor named in
        ``dtypes`` as the running engine holds it, read from the engine's own tensors (not from the files it loaded);
        ``dtypes`` gives each name's published dtype (a safetensors code), for an engine that must convert back.  A
        name the engine does not hold as one tensor of its own is left out.  An engine serving it declares
        ``policy_fingerprint``; the refresher compares it with the published one (:mod:`daskgen.worker.refresh`).
        Raises :class:`~daskgen.errors.RefreshError` when this engine cannot read its loaded tensors (the default)."""
        raise RefreshError(f"engine {self.name!r} cannot fingerprint the weights it holds")

    async def sleep(self) -> None:  # noqa: B027 - optional hook
        """Release accelerator memory while idle, where the backend supports it."""

    async def wake(self) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`sleep`."""

    @classmethod
    def is_simulated(cls, engine_args: dict[str, Any]) -> bool:
        """Whether an engine built with ``engine_args`` produces simulated (not model) output."""
        return cls.simulated

    def describe(self) -> dict[str, Any]:
        """Identity recorded in the store attrs (no secrets)."""
        return {"engine": self.name, "simulated": self.simulated}
