"""``transformers`` engine: a Hugging Face causal LM on CPU (or GPU) with continuous batching.

How it works
------------
* **Backend.**  transformers' continuous-batching manager (``model.init_continuous_batching``)
  owns the model in its own background thread.  Every step packs the prefill chunks and decode
  tokens of all running requests into one forward pass over a paged KV cache, so each request
  finishes independently: there is no static batch waiting for its longest member.
* **Results.**  A reader thread owned by this engine takes finished outputs from the manager's
  queue and resolves the awaiting coroutine on that coroutine's own event loop
  (``call_soon_threadsafe``).  :meth:`TransformersEngine.generate` only enqueues and awaits, so
  it never blocks the Dask worker's event loop; :meth:`~TransformersEngine.start` loads the
  model in a thread (``asyncio.to_thread``).
* **Sampling and seeds.**  The manager samples with a single global ``torch.multinomial`` and
  one generation config for all requests, so it can do neither per-request seeds nor (without
  extra processors) per-request temperature/top-k/top-p.  The engine therefore installs its own
  sampler as the manager's only logits processor and runs the manager greedily: for each row it
  picks the token itself and returns scores that are ``-inf`` everywhere but that token, which
  the manager's argmax then selects.  A sampled token is the Gumbel-max of the filtered scores
  (``logits / temperature``, then top-k, then top-p): ``argmax(scores + g)`` with one Gumbel
  value per token id from a ``torch.Generator`` reseeded for every step with
  ``splitmix64(seed, step)``.  The noise depends only on the request's seed and the token's
  position, not on the batch, the other requests or their order, so a resumed run that batches
  differently reproduces the same tokens.  Gumbel-max rather than an inverse CDF because it is
  robust to the last-bit differences a forward pass shows in a different batch: a draw changes
  only if the two best noisy scores are within ~1e-6 (an inverse CDF over 50k tokens accumulates
  those differences and, measured here, changed about 1 sample in 60).  Greedy
  (``temperature == 0``) is a plain argmax of the logits.  Unseeded sampled requests get a
  random seed.  The noise comes from torch's generator, so samples are reproducible for a given
  torch version and device type (both recorded by :meth:`~TransformersEngine.describe`).
* **Logprobs.**  ``log_softmax`` of the raw float32 logits at the chosen token: the model's
  untempered, unfiltered distribution, as :class:`~daskgen.engines.base.SamplingParams` says.
* **Stops.**  The model's EOS ids plus ``stop_token_ids`` end a request (``STOP``; the stop
  token is kept in the output); reaching ``max_new_tokens`` is ``LENGTH``.  Stop strings are checked
  by the sampler after each token (:class:`~daskgen.engines.stops.StopMatcher` over the tokenizer's
  ``decode``): the token completing one ends the request (``STOP``, the token kept).  Penalties,
  ``min_p`` and ``min_new_tokens`` are the sampler's too (:mod:`daskgen.engines.transformers.shaping`).
* **Errors.**  A bad request inside a batch would crash the manager's loop for everyone, so the
  engine validates every request before submitting it (prompt ids within the vocabulary, prompt
  plus ``max_new_tokens`` within the context and cache, sane sampling params) and returns
  ``GenerationResult.error`` instead.  If the manager's thread dies, pending and new requests
  get an error and :meth:`~TransformersEngine.health` raises.
* **Structured outputs.**  A request's ``response_format`` masks, before each pick, the tokens its
  format does not allow (xgrammar, :mod:`daskgen.engines.transformers.grammar`); logprobs stay those
  of the unconstrained distribution.
* **LoRA adapters.**  peft loads the ``adapters`` the engine is built with onto the one model; each request's
  tokens go through its own adapter (``SamplingParams.adapter``) inside the shared batch
  (:mod:`daskgen.engines.transformers.lora`).
* **Abort.**  ``manager.cancel_request``; the engine resolves the request at once with
  ``ABORT`` and the tokens sampled so far.

Limits: the engine uses transformers' continuous-batching internals (the manager's
``logit_processor`` and ``output_router``, ``ContinuousBatchingLogitsProcessor``); it is tested
with transformers 5.23.  Because the sampler runs Python each step, CUDA graphs, ``torch.compile``
and async double-buffering stay off: on a GPU this engine is correct but slower than ``sglang``.

Engine args (``engine_args``): see :class:`~daskgen.engines.transformers.args.TransformersArgs`.

Package layout: this module is the engine (daskgen's contract, jobs, the reader thread);
:mod:`daskgen.engines.transformers.args` holds the engine args,
:mod:`daskgen.engines.transformers.sampler` the seeded sampler and
:mod:`daskgen.engines.transformers.backend` the model and manager loading.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import queue
import threading
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from daskgen.engines.args import parse_engine_args
from daskgen.engines.base import (
    EngineStatus,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    error_result,
    set_result,
    started,
)
from daskgen.engines.continuation import split_prompt
from daskgen.engines.inprocess import InProcessEngine
from daskgen.engines.transformers.args import TransformersArgs
from daskgen.engines.transformers.backend import free_device_memory, load_backend
from daskgen.engines.transformers.grammar import Grammars
from daskgen.engines.transformers.sampler import SampledSequence, SamplerTable

__all__ = ["TransformersEngine"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- jobs


@dataclass
class _Job:
    """One submitted request, awaited on ``loop``."""

    request: GenerationRequest
    backend_id: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    sequence: SampledSequence
    stop_ids: frozenset[int]

    def resolve(self, result: GenerationResult) -> None:
        """Hand ``result`` to the awaiting coroutine (from any thread)."""
        with contextlib.suppress(RuntimeError):  # the awaiting loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(set_result, self.future, result)

    def partial(self, finish: FinishReason, error: str | None = None) -> GenerationResult:
        """A result from what the sampler picked so far (for aborts and failures)."""
        tokens = list(self.sequence.tokens)
        return self.result(tokens, finish, error)

    def result(self, tokens: list[int], finish: FinishReason, error: str | None = None) -> GenerationResult:
        logprobs = None
        if self.request.params.logprobs:
            logprobs = list(self.sequence.logprobs[: len(tokens)])
            tokens = tokens[: len(logprobs)]
        top = None
        if self.request.params.top_logprobs:
            top = list(self.sequence.top[: len(tokens)])
            tokens = tokens[: len(top)]
            logprobs = None if logprobs is None else logprobs[: len(tokens)]
        meta = {"prompt_tokens": len(self.request.prompt_ids)}
        return GenerationResult(self.request.request_id, tokens, finish, logprobs, error, meta, top)


# --------------------------------------------------------------------------- engine


class TransformersEngine(InProcessEngine):
    """A Hugging Face causal LM driven by transformers' continuous batching (see the module docstring)."""

    name = "transformers"
    simulated = False
    supports_seed = True
    continues = frozenset({"structured_outputs", "output_penalties", "seed"})
    features = frozenset(
        {
            *("per_row_sampling", "stop", "stop_token_ids", "structured_outputs", "top_logprobs"),
            *("refresh", "lora", "refresh_with_lora", "policy_fingerprint", "images"),
        }
    )

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **engine_args: Any) -> None:
        super().__init__(model, adapters, **engine_args)
        self.args = parse_engine_args(self.name, TransformersArgs, engine_args)
        self._model: Any = None
        self._manager: Any = None
        self._applied: Any = None  # the staged checkpoint last applied, until its check
        self._table = SamplerTable()
        self._table.on_error = self._fail_one
        self._jobs: dict[str, _Job] = {}
        self._by_request: dict[str, set[str]] = defaultdict(set)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._vocab_size = 0
        self._max_total_tokens = 0
        self._capacity: int | None = None
        self._tokenizer: Any = None
        self._grammars: Grammars | None = None  # compiled response formats, made on first use

    # ------------------------------------------------------------------ lifecycle

    @property
    def sampler_table(self) -> SamplerTable:
        """The per-sequence sampling state the continuous-batching thread calls at every step."""
        return self._table

    @property
    def capacity(self) -> int | None:
        """``max_requests_per_batch`` (64 on CPU unless set; transformers decides on GPU: unknown)."""
        return self._capacity

    async def load(self) -> None:
        """Load the model and start the continuous-batching thread (in a worker thread)."""
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        loaded = load_backend(self.model, self.args, self._table, self.adapters)
        self._model, self._manager = loaded.model, loaded.manager
        self._eos_ids, self._vocab_size = loaded.eos_ids, loaded.vocab_size
        self._capacity, self._max_total_tokens = loaded.capacity, loaded.max_total_tokens
        self.info = loaded.identity
        self._manager.start()
        self._reader = threading.Thread(target=self._read_outputs, name="daskgen-transformers-reader", daemon=True)
        self._reader.start()
        logger.info("transformers engine ready: %s", self.info)

    async def update_weights(self, path: str) -> None:
        """Load the checkpoint in the folder ``path`` into the running model in place
        (:func:`~daskgen.engines.transformers.weights.refresh_weights`); the model is untouched when it does not
        fit."""
        from daskgen.engines.transformers.weights import refresh_weights

        model, manager = started(self.name, self._model), started(self.name, self._manager)
        self._applied = None
        await asyncio.to_thread(refresh_weights, model, manager, path)

    async def stage_weights(self, path: str) -> Any:
        """The checkpoint in ``path`` read into host memory and fingerprinted
        (:func:`~daskgen.engines.transformers.weights.stage`)."""
        from daskgen.engines.transformers.weights import stage

        return await asyncio.to_thread(stage, started(self.name, self._model), path)

    async def apply_staged(self, staged: Any) -> float:
        """Copy a staged checkpoint into the running model in place; the next :meth:`loaded_fingerprint` proves
        the model holds it.  Returns the seconds waited for the generation step in progress to end."""
        from daskgen.engines.transformers.weights import apply_staged

        model, manager = started(self.name, self._model), started(self.name, self._manager)
        self._applied = None
        waited = await asyncio.to_thread(apply_staged, model, manager, staged)
        self._applied = staged
        return waited

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint of each tensor named in ``dtypes`` in the running model's state dict (under a plain
        checkpoint's names): after :meth:`apply_staged`, the staged fingerprint of each tensor proved to hold the
        staged bytes, the hash of any other (:func:`~daskgen.engines.transformers.weights.held_fingerprint`)."""
        from daskgen.engines.transformers.weights import held_fingerprint

        model, staged, self._applied = started(self.name, self._model), self._applied, None
        return await asyncio.to_thread(held_fingerprint, model, staged, dtypes)

    async def unload(self) -> None:
        """Fail pending requests, stop the backend thread and free the model."""
        self._fail_all(FinishReason.ABORT, "the engine was shut down")
        await asyncio.to_thread(self._stop_backend)

    def _stop_backend(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.stop(block=True, timeout=60, hard_stop=True)
                manager.destroy()
            except Exception:  # a crashed manager may fail to stop; the model is released anyway
                logger.warning("stopping the continuous-batching manager failed", exc_info=True)
            manager.output_router.output_queue.put(None)  # wakes and ends the reader
        if self._reader is not None:
            self._reader.join(timeout=10)
            self._reader = None
        self._model = None
        gc.collect()
        free_device_memory()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample; errors come back in ``GenerationResult.error``."""
        problem = self.refusal(request)
        if problem is not None:
            return error_result(request, problem)
        constraint = None
        if request.params.response_format is not None:
            try:
                constraint, broken = await asyncio.to_thread(self._constraint, request)
            except Exception as exc:  # xgrammar refuses a schema, regex or grammar it cannot compile
                return error_result(request, f"response_format cannot be compiled: {type(exc).__name__}: {exc}")
            if broken is not None:
                return error_result(request, f"response_format cannot continue this response: {broken}")
        job = self._submit(request, asyncio.get_running_loop(), constraint)
        if isinstance(job, GenerationResult):
            return job
        try:
            return await job.future
        except asyncio.CancelledError:
            self._cancel(job.backend_id)
            raise

    def _constraint(self, request: GenerationRequest) -> tuple[Any, str | None]:
        """The grammar state of a request with a ``response_format``, advanced over a continuation's tokens so far,
        and what is wrong when they break the format (blocking: compiles on first use)."""
        if self._grammars is None:
            tokenizer_args = {"trust_remote_code": self.args.trust_remote_code, "revision": self.args.revision}
            self._grammars = Grammars(self.model, self._vocab_size, tokenizer_args)
        params = request.params
        assert params.response_format is not None
        constraint = self._grammars.constraint(params.response_format, self._eos_ids | frozenset(params.stop_token_ids))
        return constraint, constraint.advance(split_prompt(request.prompt_ids, params.continued)[1])

    def _submit(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, constraint: Any = None
    ) -> _Job | GenerationResult:
        backend_id = f"{request.request_id}#{next(self._ids)}"
        stop_ids = self._eos_ids | frozenset(request.params.stop_token_ids)
        params = dataclasses.replace(request.params, stop_token_ids=tuple(sorted(stop_ids)))
        decode = self._decoder() if params.stop else None
        sequence = SampledSequence.from_params(
            params, request.prompt_ids, decode, functools.partial(self._stop_early, backend_id)
        )
        job = _Job(request, backend_id, loop, loop.create_future(), sequence, stop_ids)
        job.sequence.constraint = constraint
        with self._lock:
            self._jobs[backend_id] = job
            self._by_request[request.request_id].add(backend_id)
            self._table.add(backend_id, job.sequence)
        added = started(self.name, self._manager).add_request(
            list(request.prompt_ids),
            request_id=backend_id,
            max_new_tokens=request.params.max_new_tokens,
            eos_token_id=sorted(job.stop_ids),
            **({"images": request.params.images} if request.params.images else {}),  # a vision model's backend
        )
        if added is None:
            self._pop_job(backend_id)
            return error_result(request, f"transformers engine is not accepting requests: {self._backend_problem()}")
        return job

    async def abort(self, request_id: str) -> None:
        """End every in-flight request with this id; each returns ``ABORT`` with its tokens so far."""
        with self._lock:
            backend_ids = list(self._by_request.get(request_id, ()))
        for backend_id in backend_ids:
            job = self._cancel(backend_id)
            if job is not None:
                job.resolve(job.partial(FinishReason.ABORT))

    def _stop_early(self, backend_id: str) -> None:
        """End a request whose newest token completed a stop string (called from the sampling thread)."""
        job = self._cancel(backend_id)
        if job is not None:
            job.resolve(job.partial(FinishReason.STOP))

    def _fail_one(self, backend_id: str, message: str) -> None:
        """End one request whose sampling raised (called from the sampling thread); the others go on."""
        job = self._cancel(backend_id)
        if job is not None:
            logger.warning("transformers engine: request %s failed: %s", job.request.request_id, message)
            job.resolve(job.partial(FinishReason.ERROR, message))

    def _decoder(self) -> Any:
        """The tokenizer's ``decode`` (loaded on the first request with stop strings)."""
        with self._lock:
            if self._tokenizer is None:
                from daskgen.engines.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.model, self.name, self.engine_args)
        return functools.partial(self._tokenizer.decode, skip_special_tokens=False)

    def _cancel(self, backend_id: str) -> _Job | None:
        job = self._pop_job(backend_id)
        if job is not None and self._manager is not None:
            self._manager.cancel_request(backend_id)
        return job

    def _pop_job(self, backend_id: str) -> _Job | None:
        with self._lock:
            job = self._jobs.pop(backend_id, None)
            self._table.remove(backend_id)
            if job is not None:
                ids = self._by_request.get(job.request.request_id)
                if ids is not None:
                    ids.discard(backend_id)
                    if not ids:
                        del self._by_request[job.request.request_id]
        return job

    def _fail_all(self, finish: FinishReason, message: str) -> None:
        with self._lock:
            backend_ids = list(self._jobs)
        for backend_id in backend_ids:
            job = self._pop_job(backend_id)
            if job is not None:
                job.resolve(job.partial(finish, message if finish == FinishReason.ERROR else None))

    # ------------------------------------------------------------------ backend thread side

    def _read_outputs(self) -> None:
        """Reader thread: route finished outputs to their jobs; notice a dead backend."""
        output_queue = self._manager.output_router.output_queue
        while True:
            try:
                output = output_queue.get(timeout=0.5)
            except queue.Empty:
                self._check_backend()
                continue
            if output is None:
                return
            if output.is_finished():
                job = self._pop_job(output.request_id)
                if job is not None:
                    job.resolve(self._to_result(job, output))

    def _to_result(self, job: _Job, output: Any) -> GenerationResult:
        tokens = list(output.generated_tokens)
        if output.error is not None:
            return job.result(tokens, FinishReason.ERROR, f"generation failed: {output.error}")
        finish = FinishReason.STOP if tokens and tokens[-1] in job.stop_ids else FinishReason.LENGTH
        return job.result(tokens, finish)

    def _check_backend(self) -> None:
        if self.status is EngineStatus.RUNNING and self._backend_problem() is not None:
            self.status = EngineStatus.CRASHED
            self._fail_all(FinishReason.ERROR, f"the generation thread stopped: {self._backend_problem()}")

    def _backend_problem(self) -> str | None:
        manager = self._manager
        if manager is None:
            return "the backend is stopped"
        status = manager.background_thread_status
        if status.fatal_error is not None:
            return f"{type(status.fatal_error).__name__}: {status.fatal_error}"
        if not manager.is_running():
            return "the generation thread is not running"
        return None

    # ------------------------------------------------------------------ introspection

    def crash(self) -> str | None:
        """What stopped the generation thread, while the engine runs."""
        return self._backend_problem()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every request (the model's EOS ids); known after :meth:`start`."""
        return self._eos_ids

    @property
    def vocab_size(self) -> int | None:
        """Rows of the model's input embedding; known after :meth:`start`."""
        return self._vocab_size or None

    @property
    def max_total_tokens(self) -> int:
        """Largest prompt plus ``max_new_tokens`` one request may have; known after :meth:`start`."""
        return self._max_total_tokens

    def described_args(self) -> dict[str, Any]:
        """Every option, defaults included."""
        return asdict(self.args)
