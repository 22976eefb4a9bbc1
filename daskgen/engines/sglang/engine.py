"""``sglang`` engine: one in-process ``sglang.Engine`` per Dask worker (tested with sglang 0.5.23).

How it works
------------
* **Ownership.**  ``sglang.Engine`` is not safe to drive from the Dask worker's event loop:
  ``asyncio.run(engine.async_generate(...))`` hangs, and its request bookkeeping lives on the
  loop it was created for.  :class:`SGLangEngine` therefore creates the ``sglang.Engine`` in a
  dedicated thread (``daskgen-sglang``) that then runs that loop forever.  Every call is a
  coroutine submitted to that loop with :func:`asyncio.run_coroutine_threadsafe`; the caller
  awaits the resulting concurrent future with :func:`asyncio.wrap_future`, so the worker's loop
  never blocks (the ~20 s launch and the ~6 s ``import sglang`` also happen in that thread).
* **Token in, token out.**  Requests go in as ``input_ids`` with ``rid=f"{request_id}#{n}"`` (a
  counter, because one request id may be in flight twice and sglang refuses duplicates); results
  come back as ``output_ids`` (a matched EOS or stop token is kept, as in every daskgen engine),
  ``meta_info.finish_reason.type`` (``stop``/``length``/``abort``) and, when asked,
  ``meta_info.output_token_logprobs``.  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` is set so those
  logprobs come from the untempered distribution, as :class:`~daskgen.engines.base.SamplingParams`
  specifies.  Requests that sglang would choke on are rejected before they reach it
  (:func:`~daskgen.engines.base.request_error`): a prompt token outside the vocabulary kills
  sglang's scheduler process (seen with 0.5.23), not just the request.
* **Images.**  A request's images go in as ``image_data``: one ``processor_output`` item with the pixel
  values the worker's image processor made, each image's grid and its placeholder offsets in the
  (already expanded) ``input_ids`` (:mod:`daskgen.engines.sglang.images`); sglang neither reloads,
  resizes nor re-expands them, so it generates from the pixels and prompt the store records.  A
  request with images to an sglang started without a multimodal processor is an error.
* **Seeds.**  sglang honours ``sampling_seed`` only with ``enable_deterministic_inference=True``
  (which needs the fa3, flashinfer, triton, ... attention backends, i.e. a GPU).  The seed is
  always passed; :attr:`SGLangEngine.supports_seed` is true only when that option is on.
* **Abort.**  ``sglang.Engine`` has no ``abort``; the engine calls
  ``engine.tokenizer_manager.abort_request(rid=...)`` on the engine's loop (waiting briefly
  for a just-submitted request to register).  The request returns ``ABORT`` with the tokens
  generated so far.
* **Crashes.**  sglang runs its scheduler and detokenizer as subprocesses.  A monitor on the
  engine's loop notices when one of them exits; in-flight and later requests then get an
  error, :meth:`SGLangEngine.crash` names the cause (so the partition fails as a whole and is
  retried, see :meth:`~daskgen.engines.base.Engine.died`) and :meth:`SGLangEngine.health` raises,
  so the plugin restarts the engine.  A failing
  sglang subprocess also sends ``SIGQUIT`` to its parent, i.e. the Dask worker process, whose
  default action kills it (sglang only installs its own handler when ``sglang.Engine`` is
  created on the main thread, which it is not here).  :meth:`SGLangEngine.start` installs a
  ``SIGQUIT`` handler that logs and triggers the monitor instead, when it is called on the main
  thread (the Dask worker's event loop runs there); otherwise it logs a warning.
* **Shutdown.**  ``sglang.Engine.shutdown()`` SIGKILLs *every* child process of the calling
  process (``kill_process_tree(os.getpid())``), and sglang registers it with :mod:`atexit`.
  In a Dask worker started by a nanny, the worker's children are sglang's processes plus
  whatever else lives there (Python's multiprocessing resource tracker, processes a task
  started); in a process that is not a dedicated worker (``LocalCluster(processes=False)``, a
  test, a notebook) they can include the cluster's own worker processes.  Daskgen therefore
  never calls it: :meth:`SGLangEngine.shutdown` stops sglang's subprocess watchdog, SIGKILLs
  exactly the processes this engine launched (and their descendants), stops the engine's
  thread, closes sglang's ZeroMQ sockets without lingering (else garbage-collecting their
  context blocks forever once the peers are dead) and removes sglang's ``atexit`` hook.
* **Daemonic workers.**  Dask starts worker processes as daemons by default
  (``distributed.worker.daemon: true``) and a daemonic process may not have children, which
  sglang needs.  :meth:`SGLangEngine.start` raises :class:`~daskgen.errors.EngineError`
  explaining the fix (``distributed.worker.daemon: false``) in such a process.  sglang also
  switches the process's multiprocessing start method to ``spawn``, and spawned children
  re-import the parent's ``__main__``: a script that creates a cluster needs the usual
  ``if __name__ == "__main__":`` guard.
* **CPU.**  Without CUDA (or with ``device="cpu"``) the engine sets ``SGLANG_USE_CPU_ENGINE=1``
  and defaults to :data:`~daskgen.engines.sglang.args.CPU_DEFAULTS`.  sglang on CPU still imports
  its CUDA kernel package ``sgl_kernel``; see ``.ci/sglang-env.sh`` for the CPU test lane.
* **Sleep.**  :meth:`~SGLangEngine.sleep`/:meth:`~SGLangEngine.wake` release and resume GPU
  memory (weights, KV cache, CUDA graphs) when the engine runs on CUDA with
  ``enable_memory_saver=True``; otherwise they do nothing (on CPU sglang's release crashes its
  scheduler).

Engine args (``engine_args``) are ``sglang.Engine`` / ``ServerArgs`` keyword arguments, passed
through unchanged (``tp_size``, ``mem_fraction_static``, ``context_length``,
``attention_backend``, ``dtype``, ``device``, ``max_total_tokens``, ...); unknown names raise
:class:`~daskgen.errors.ConfigError` listing the valid ones.  Heavy imports (sglang, torch)
happen inside methods only.

Package layout: this module is the engine (daskgen's contract);
:mod:`daskgen.engines.sglang.mapping` translates requests and outputs (shared with the HTTP
engine's native protocol); :mod:`daskgen.engines.sglang.args` holds the engine args (shared with
the managed HTTP server); :mod:`daskgen.engines.sglang.backend` launches and owns the
``sglang.Engine`` (the engine's thread and loop, subprocess monitoring, shutdown);
:mod:`daskgen.engines.sglang.sigquit` holds the ``SIGQUIT`` handler.  What all in-process engines
share (start errors, refusals, health, sleep/wake, ``describe``) is
:class:`~daskgen.engines.inprocess.InProcessEngine`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from daskgen.engines.base import GenerationRequest, GenerationResult, aborted_result, error_result, started
from daskgen.engines.continuation import request_limit
from daskgen.engines.inprocess import InProcessEngine, cuda_available
from daskgen.engines.sglang.args import (
    SAMPLING_RANGES,
    is_cpu_device,
    launch_kwargs,
    lora_refusal,
    prefix_admission,
    refuse_model_path,
)
from daskgen.engines.sglang.backend import BackendClosed, BackendCrashed, SGLangBackend, read_max_running_requests
from daskgen.engines.sglang.images import image_data, images_refusal
from daskgen.engines.sglang.mapping import logprob_request, result_from_output, sampling_params_for
from daskgen.engines.sglang.sigquit import install_sigquit_handler, restore_sigquit_handler
from daskgen.engines.sglang.weights import (
    StagedTensors,
    flush_when_idle,
    load_tensors,
    loaded_but_not_flushed,
    read_tensors,
)
from daskgen.errors import EngineError, RefreshError
from daskgen.redaction import redact

__all__ = ["TESTED_SGLANG_VERSION", "SGLangEngine"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: The sglang release this engine is tested against (CPU lane, ``.ci/sglang-env.sh``).
TESTED_SGLANG_VERSION = "0.5.23"

# --------------------------------------------------------------------------- the engine


class SGLangEngine(InProcessEngine):
    """daskgen's engine contract on top of one in-process ``sglang.Engine`` (see the module doc).

    Parameters
    ----------
    model:
        Model folder (or name sglang can load; no hub access is assumed).
    **engine_args:
        ``sglang.Engine`` keyword arguments (``ServerArgs`` fields).
    """

    name = "sglang"
    starts_subprocesses = True
    features = frozenset(
        {
            *("per_row_sampling", "stop", "stop_token_ids", "structured_outputs", "top_logprobs"),
            *("refresh", "lora", "refresh_with_lora", "policy_fingerprint", "images"),
        }
    )
    sampling_ranges = SAMPLING_RANGES

    @classmethod
    def refused_features(cls, engine_args: dict[str, Any]) -> dict[str, str]:
        """LoRA (and a refresh under adapters) on a CPU device (:data:`~daskgen.engines.sglang.args.LORA_ON_CPU`);
        images under engine args that turn sglang's image path off (:mod:`daskgen.engines.sglang.images`)."""
        return {**lora_refusal(engine_args, cuda_available), **images_refusal(engine_args)}

    @classmethod
    def prefix_admission(cls, engine_args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """sglang under ``schedule_policy: lpm`` unless ``engine_args`` set another (:data:`PREFIX_ARGS`)."""
        return prefix_admission(engine_args)

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **engine_args: Any) -> None:
        super().__init__(model, adapters, **engine_args)
        refuse_model_path(engine_args)
        self._backend: SGLangBackend | None = None
        self._kwargs: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Launch ``sglang.Engine`` in the engine's own thread (~20 s for a tiny model on CPU)."""
        if not install_sigquit_handler():
            logger.warning(
                "sglang engine started off the main thread: cannot install a SIGQUIT handler, so a "
                "crashing sglang subprocess will terminate this process (SIGQUIT's default action)"
            )
        cuda = await asyncio.to_thread(cuda_available)
        self._kwargs = launch_kwargs(self.model, self.engine_args, cuda, self.adapters)
        backend = self._backend = SGLangBackend(self._kwargs)
        await asyncio.wrap_future(backend.launch())
        backend.info["max_running_requests"] = await read_max_running_requests(backend)
        backend.info["images"] = getattr(backend.engine.tokenizer_manager, "mm_processor", None) is not None
        self.info = backend.info
        logger.info("sglang engine ready: %s", self.info)

    def launch_description(self) -> str:
        """``sglang.Engine(<kwargs>)`` (secrets redacted)."""
        return f"sglang.Engine({redact(self._kwargs)})"

    async def unload(self) -> None:
        """Stop the engine's thread and kill the processes it launched."""
        backend, self._backend = self._backend, None
        if backend is not None:
            await asyncio.to_thread(backend.stop)
        restore_sigquit_handler()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample; errors come back in ``GenerationResult.error``."""
        problem = self.refusal(request) or self._prompt_too_long(request) or self._no_images(request)
        if problem is not None:
            return error_result(request, problem)
        kwargs = {
            "input_ids": list(request.prompt_ids),
            "sampling_params": sampling_params_for(request.params),
            **logprob_request(request.params),
            **({"lora_path": request.params.adapter} if request.params.adapter else {}),
            **({"image_data": image_data(request.params.images)} if request.params.images else {}),
        }
        return await self._run(request, kwargs)

    async def _run(self, request: GenerationRequest, kwargs: dict[str, Any]) -> GenerationResult:
        try:
            backend = started(self.name, self._backend)
            future = backend.submit(backend.generate(request.request_id, kwargs))
            output = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            raise  # wrap_future has cancelled the submission; the backend aborts the request
        except BackendClosed:
            return aborted_result(request)
        except BackendCrashed as exc:
            return error_result(request, f"sglang engine crashed: {exc}")
        except Exception as exc:  # sglang rejects some requests by raising (e.g. ValueError)
            return error_result(request, f"sglang rejected the request: {type(exc).__name__}: {exc}")
        return result_from_output(request, output)

    def _prompt_too_long(self, request: GenerationRequest) -> str | None:
        limit = self.info.get("max_req_input_len")
        if limit is not None and len(request.prompt_ids) > limit:
            return (
                f"request {request.request_id!r}: prompt has {len(request.prompt_ids)} tokens; "
                f"sglang accepts at most {limit}"
            )
        return None

    def _no_images(self, request: GenerationRequest) -> str | None:
        if request.params.images and not self.info.get("images", False):
            return (
                f"request {request.request_id!r} has images, but sglang started without a multimodal processor for "
                f"{self.model!r}: it would read the image placeholders as text"
            )
        return None

    async def abort(self, request_id: str) -> None:
        """End the request; its ``generate`` returns ``ABORT`` with the tokens so far."""
        await self.abort_on_loop(self._backend, lambda backend: backend.abort(request_id), BackendClosed)

    # ------------------------------------------------------------------ crash, memory, identity

    def crash(self) -> str | None:
        """What the subprocess monitor found (a dead sglang subprocess), or ``None``."""
        return self._backend.problem if self._backend is not None else "the backend is stopped"

    @property
    def backend(self) -> SGLangBackend | None:
        """The running backend (its thread, ``sglang.Engine`` and subprocesses); ``None`` when not started."""
        return self._backend

    async def on_engine_loop(self, work: Callable[[Any], Coroutine[Any, Any, _T]]) -> _T:
        """Await ``work(sglang_engine)`` on the engine's own loop, where the ``sglang.Engine`` lives: for code that
        drives sglang itself beside daskgen's requests (the GPU validation's raw side runs on the engine daskgen
        started).  A crash or shutdown ends it as it ends daskgen's requests, with :class:`EngineError`."""
        backend = started(self.name, self._backend)
        try:
            return await asyncio.wrap_future(backend.submit(backend.run_native(work)))
        except BackendCrashed as exc:
            raise EngineError(f"sglang engine crashed: {exc}") from exc
        except BackendClosed as exc:
            raise EngineError(str(exc)) from exc

    @property
    def supports_seed(self) -> bool:
        """sglang honours ``sampling_seed`` only with ``enable_deterministic_inference=True``."""
        return bool(self.engine_args.get("enable_deterministic_inference", False))

    @property
    def sleep_supported(self) -> bool:
        """True when :meth:`sleep` really releases memory (CUDA with ``enable_memory_saver``)."""
        device = self._kwargs.get("device", "cpu")
        return not is_cpu_device(device) and bool(self._kwargs.get("enable_memory_saver"))

    def requests_in_flight(self) -> int:
        """Requests the backend tracks."""
        return len(self._backend.tasks) if self._backend is not None else 0

    async def update_weights(self, path: str) -> None:
        """Load the checkpoint in the folder ``path`` in place (sglang's ``update_weights_from_disk``, which keeps
        the old weights when the load fails: then :class:`~daskgen.errors.RefreshError`)."""
        backend = started(self.name, self._backend)
        ok, message = await asyncio.wrap_future(backend.submit(backend.update_weights(path)))
        if not ok and loaded_but_not_flushed(message):  # loaded while requests ran: the old weights' cache stays
            await flush_when_idle(self.flush_cache, path, "sglang")
        elif not ok:
            raise RefreshError(f"sglang could not load policy checkpoint {path!r} (it keeps its weights): {message}")

    async def stage_weights(self, path: str) -> StagedTensors | str:
        """Read the tensors of the folder ``path`` into host memory while the engine generates; a folder without
        safetensors files stays a folder, loaded from disk in the pause."""
        staged = await asyncio.to_thread(read_tensors, path)
        return path if staged is None else staged

    async def apply_staged(self, staged: Any) -> None:
        """Load staged tensors in place from host memory (sglang's ``update_weights_from_tensor``: the pause reads
        no file); where sglang refuses them, load their folder with :meth:`update_weights` instead."""
        if not isinstance(staged, StagedTensors):
            return await self.update_weights(staged)
        backend = started(self.name, self._backend)
        tp_size = int(self._kwargs.get("tp_size") or 1)
        manager = backend.engine.tokenizer_manager
        ok, message = await asyncio.wrap_future(backend.submit(load_tensors(manager, staged, tp_size)))
        if not ok and loaded_but_not_flushed(message):
            await flush_when_idle(self.flush_cache, staged.path, "sglang")
        elif not ok:
            logger.warning("daskgen: sglang refused %s from memory (%s); loading its folder", staged.path, message)
            await self.update_weights(staged.path)
        return None

    async def flush_cache(self, timeout_s: float) -> bool:
        """Drop sglang's prefix cache; ``True`` once dropped (sglang waits up to ``timeout_s`` for the requests in
        flight).  Used after a refresh that loaded while requests ran (:func:`flush_when_idle`), and between the
        two sides of a comparison on one engine (the GPU validation)."""
        backend = started(self.name, self._backend)
        return await asyncio.wrap_future(backend.submit(backend.flush_cache(timeout_s)))

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint of each tensor named in ``dtypes`` as sglang holds it, read back with its
        ``get_weights_by_name`` (:mod:`daskgen.engines.sglang.fingerprint`)."""
        from daskgen.engines.sglang.fingerprint import ALL_ROWS, fingerprint_of_values, unsliceable

        backend, out, skipped = started(self.name, self._backend), {}, unsliceable(self.model)
        for name, dtype in dtypes.items():
            if any(part in name for part in skipped):
                continue
            values = await asyncio.wrap_future(backend.submit(backend.weights(name, ALL_ROWS)))
            if (found := await asyncio.to_thread(fingerprint_of_values, values, dtype)) is not None:
                out[name] = found
        return out

    async def set_memory(self, release: bool) -> None:
        """Release or resume sglang's GPU memory (weights, KV cache, CUDA graphs)."""
        backend = started(self.name, self._backend)
        await asyncio.wrap_future(backend.submit(backend.memory(release)))

    @property
    def max_total_tokens(self) -> int | None:
        """Largest prompt plus ``max_new_tokens`` of one request such that every continuation of it fits too (its
        prompt and tokens so far at most sglang's ``max_req_input_len``); known after :meth:`start`."""
        context, pool = self.info.get("context_length"), self.info.get("max_total_num_tokens")
        if context is None:
            return None
        prompts = self.info.get("max_req_input_len")
        return min(context, pool or context, request_limit(prompts or context))

    @property
    def capacity(self) -> int | None:
        """The scheduler's ``max_running_requests`` (set in ``engine_args`` or sized by sglang from its
        KV pool), read after :meth:`start`; ``None`` when sglang did not report it."""
        value = self.info.get("max_running_requests") or self.engine_args.get("max_running_requests")
        return int(value) if isinstance(value, int) and value > 0 else None

    def described_args(self) -> dict[str, Any]:
        """The ``sglang.Engine`` options used (secrets redacted)."""
        return redact(self._kwargs or self.engine_args)
