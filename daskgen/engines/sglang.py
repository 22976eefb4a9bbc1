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
* **Seeds.**  sglang honours ``sampling_seed`` only with ``enable_deterministic_inference=True``
  (which needs the fa3, flashinfer, triton, ... attention backends, i.e. a GPU).  The seed is
  always passed; :attr:`SGLangEngine.supports_seed` is true only when that option is on.
* **Abort.**  ``sglang.Engine`` has no ``abort``; the engine calls
  ``engine.tokenizer_manager.abort_request(rid=...)`` on the engine's loop (waiting briefly
  for a just-submitted request to register).  The request returns ``ABORT`` with the tokens
  generated so far.
* **Crashes.**  sglang runs its scheduler and detokenizer as subprocesses.  A monitor on the
  engine's loop notices when one of them exits; in-flight and later requests then get an
  error and :meth:`SGLangEngine.health` raises, so the plugin restarts the engine.  A failing
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
  and defaults to :data:`CPU_DEFAULTS`.  sglang on CPU still imports its CUDA kernel package
  ``sgl_kernel``; see ``.ci/sglang-env.sh`` for the CPU test lane.
* **Sleep.**  :meth:`~SGLangEngine.sleep`/:meth:`~SGLangEngine.wake` release and resume GPU
  memory (weights, KV cache, CUDA graphs) when the engine runs on CUDA with
  ``enable_memory_saver=True``; otherwise they do nothing (on CPU sglang's release crashes its
  scheduler).

Engine args (``engine_args``) are ``sglang.Engine`` / ``ServerArgs`` keyword arguments, passed
through unchanged (``tp_size``, ``mem_fraction_static``, ``context_length``,
``attention_backend``, ``dtype``, ``device``, ``max_total_tokens``, ...); unknown names raise
:class:`~daskgen.errors.ConfigError` listing the valid ones.  Heavy imports (sglang, torch)
happen inside methods only.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import difflib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from daskgen.engines.base import (
    Engine,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    error_result,
    request_error,
)
from daskgen.errors import ConfigError, EngineError

__all__ = [
    "CPU_DEFAULTS",
    "TESTED_SGLANG_VERSION",
    "SGLangEngine",
    "check_engine_args",
    "install_sigquit_handler",
    "launch_kwargs",
    "result_from_output",
    "sampling_params_for",
    "server_arg_names",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The sglang release this engine is tested against (CPU lane, ``.ci/sglang-env.sh``).
TESTED_SGLANG_VERSION = "0.5.23"
#: ``sglang.Engine`` options filled in on CPU when ``engine_args`` does not set them.  float32
#: matches the ``transformers`` engine's CPU default (sglang's ``auto`` would pick float16).
CPU_DEFAULTS: dict[str, Any] = {"attention_backend": "torch_native", "dtype": "float32", "max_total_tokens": 16384}
#: How the Dask fix for daemonic worker processes is spelled, for error messages and docs.
DAEMON_FIX = (
    "set the Dask config `distributed.worker.daemon: false` before the cluster starts its workers "
    "(e.g. `dask.config.set({'distributed.worker.daemon': False})` before creating a LocalCluster, "
    "`DASK_DISTRIBUTED__WORKER__DAEMON=False` in the environment of `dask worker`/dask-jobqueue jobs), "
    "or run workers without a nanny (`dask worker --no-nanny`)"
)

_MODEL_PATH_ERROR = "sglang engine: give the model as daskgen's `model`, not as engine_args['model_path']"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_SECRET_SUFFIXES = ("key", "key_b", "password", "secret")
_MONITOR_INTERVAL = 0.5
_ABORT_WAIT = 2.0
_STOP_TIMEOUT = 60.0
_LAUNCH_WAIT = 900.0


# --------------------------------------------------------------------------- engine args


def server_arg_names() -> list[str]:
    """Names of the keyword arguments ``sglang.Engine`` accepts (its ``ServerArgs`` fields).

    Imports sglang (a few seconds); set ``SGLANG_USE_CPU_ENGINE`` before calling on a CPU.
    """
    import msgspec
    from sglang.srt.server_args import ServerArgs

    return sorted(f.name for f in msgspec.structs.fields(ServerArgs) if not f.name.startswith("_"))


def check_engine_args(engine_args: Mapping[str, Any], valid: list[str] | None = None) -> None:
    """Raise :class:`ConfigError` for keys of ``engine_args`` that sglang does not know.

    ``valid`` defaults to :func:`server_arg_names` (which imports sglang).  The message suggests
    close matches and lists every valid name.
    """
    if "model_path" in engine_args:
        raise ConfigError(_MODEL_PATH_ERROR)
    names = server_arg_names() if valid is None else valid
    unknown = sorted(set(engine_args) - set(names))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(key))
    raise ConfigError(
        f"sglang engine: unknown engine_args {', '.join(hints)}. engine_args are passed to "
        f"sglang.Engine(...) and must be sglang ServerArgs fields; valid names are: {', '.join(names)}"
    )


def launch_kwargs(model: str, engine_args: Mapping[str, Any], cuda_available: bool) -> dict[str, Any]:
    """The keyword arguments for ``sglang.Engine``: ``engine_args`` plus daskgen's defaults.

    The device is ``engine_args['device']`` or, when absent, ``cuda`` if available else
    ``cpu``; on CPU the :data:`CPU_DEFAULTS` fill options ``engine_args`` leaves unset.
    """
    kwargs = dict(engine_args)
    kwargs["model_path"] = model
    device = kwargs.get("device") or ("cuda" if cuda_available else "cpu")
    kwargs["device"] = device
    if _is_cpu(device):
        for key, value in CPU_DEFAULTS.items():
            kwargs.setdefault(key, value)
    return kwargs


def _is_cpu(device: str) -> bool:
    return str(device).split(":", 1)[0] == "cpu"


def _redacted(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with values of secret-looking keys replaced (for logs and store attrs)."""
    return {k: ("<redacted>" if k.endswith(_SECRET_SUFFIXES) and v else v) for k, v in kwargs.items()}


# --------------------------------------------------------------------------- requests and results


def sampling_params_for(params: SamplingParams) -> dict[str, Any]:
    """sglang's ``sampling_params`` dict for daskgen's :class:`SamplingParams`.

    ``top_k == 0`` (off) becomes sglang's ``-1``; ``temperature == 0`` is greedy in both.
    """
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = sorted(set(params.stop_token_ids))
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def result_from_output(request: GenerationRequest, output: Mapping[str, Any]) -> GenerationResult:
    """Turn one ``async_generate`` output dict into a :class:`GenerationResult`."""
    meta = output.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else None
    finish = _FINISH.get(kind, FinishReason.ERROR)
    tokens = [int(t) for t in output.get("output_ids") or []]
    logprobs = None
    if request.params.logprobs:
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
    error = None if finish != FinishReason.ERROR else f"sglang returned finish_reason {reason!r}"
    extra = {k: meta[k] for k in ("prompt_tokens", "cached_tokens") if k in meta}
    return GenerationResult(request.request_id, tokens, finish, logprobs, error=error, meta=extra)


# --------------------------------------------------------------------------- SIGQUIT from sglang children

_BACKENDS: weakref.WeakSet[_Backend] = weakref.WeakSet()
_previous_sigquit: Any = None
_sigquit_installed = False


def _on_sigquit(signum: int, frame: Any) -> None:
    """Handle the SIGQUIT a failing sglang subprocess sends its parent: check, do not die."""
    logger.error("SIGQUIT received (an sglang subprocess reports a failure); checking the sglang engines")
    for backend in list(_BACKENDS):
        backend.poke()


def install_sigquit_handler() -> bool:
    """Make SIGQUIT from a failing sglang subprocess mark the engine crashed instead of killing us.

    Installed once per process; only possible on the main thread (returns False elsewhere).
    :meth:`SGLangEngine.start` calls it; call it yourself from the main thread when engines are
    started on another thread (e.g. a test's background event loop).
    """
    global _previous_sigquit, _sigquit_installed
    if _sigquit_installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _previous_sigquit = signal.signal(signal.SIGQUIT, _on_sigquit)
    _sigquit_installed = True
    return True


def _restore_sigquit_handler() -> None:
    """Give SIGQUIT back its previous handler once no engine is alive (main thread only)."""
    global _sigquit_installed
    if not _sigquit_installed or len(_BACKENDS) or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGQUIT, _previous_sigquit if _previous_sigquit is not None else signal.SIG_DFL)
    _sigquit_installed = False


# --------------------------------------------------------------------------- the engine's thread


class _Crashed(Exception):
    """The sglang engine's subprocesses died."""


class _Closed(Exception):
    """The engine was shut down while the request was in flight."""


class _Backend:
    """A ``sglang.Engine`` plus the thread and event loop that own it."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.engine: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.problem: str | None = None
        self.closing = False
        self.info: dict[str, Any] = {}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.rids: dict[str, set[str]] = {}
        self._ids = itertools.count()
        self._children: list[Any] = []
        self._submitted: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self._launched: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._launch_done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="daskgen-sglang", daemon=True)

    # ---- lifecycle (called from outside the engine's thread)

    def launch(self) -> concurrent.futures.Future[None]:
        """Start the thread; the future resolves once ``sglang.Engine`` is up."""
        self._thread.start()
        return self._launched

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coro`` on the engine's loop; shutdown resolves it with :class:`_Closed` if it never ran."""
        with self._lock:
            if self.closing or self.loop is None or self.loop.is_closed():
                coro.close()
                raise _Closed("the sglang engine is shut down")
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._submitted.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._submitted.discard(future)

    def poke(self) -> None:
        """Ask the monitor to check the subprocesses now (thread- and signal-safe enough)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._check_children)

    def stop(self) -> None:
        """Blocking: stop the loop and thread, kill exactly this engine's processes."""
        with self._lock:
            self.closing = True
        _BACKENDS.discard(self)
        if self._thread.is_alive():
            self._launch_done.wait(_LAUNCH_WAIT)
        engine = self.engine
        if engine is not None:
            _stop_watchdog(engine)
        loop = self.loop
        if loop is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(self._cancel_all)
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # the loop closed meanwhile
                pass
            self._thread.join(timeout=_STOP_TIMEOUT)
        self._fail_unstarted()
        _kill(self._children)
        self._children = []
        self.engine = None
        if engine is not None:
            _release(engine)

    def _fail_unstarted(self) -> None:
        """Resolve submissions the stopped loop never ran, so no caller waits forever."""
        with self._lock:
            pending = list(self._submitted)
        for future in pending:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(_Closed("the sglang engine was shut down"))

    # ---- the engine's thread

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            self._create_engine()
        except BaseException as exc:
            _drain(loop)
            _close_sockets(self.engine)
            loop.close()
            self._launch_done.set()
            _settle(self._launched, exc)
            return
        self._launch_done.set()
        monitor = loop.create_task(self._monitor())
        _settle(self._launched, None)
        try:
            if not self.closing:
                loop.run_forever()
        finally:
            monitor.cancel()
            _drain(loop)  # cancels sglang's own tasks too, before their sockets close under them
            _close_sockets(self.engine)
            loop.close()

    def _create_engine(self) -> None:
        import psutil

        _prepare_environment(self.kwargs["device"])
        import sglang

        check_engine_args({k: v for k, v in self.kwargs.items() if k != "model_path"})
        before = {p.pid for p in psutil.Process().children()}
        try:
            self.engine = sglang.Engine(**self.kwargs)
        except BaseException:
            _kill(_new_sglang_children(before, []))
            raise
        self._children = _new_sglang_children(before, _child_pids(self.engine))
        self.info = _engine_info(self.engine, sglang.__version__)

    async def _monitor(self) -> None:
        while self.problem is None:
            await asyncio.sleep(_MONITOR_INTERVAL)
            self._check_children()

    def _check_children(self) -> None:
        if self.problem is not None or self.closing or self.engine is None:
            return
        problem = _dead_child(self._children)
        if problem is None:
            return
        self.problem = problem
        logger.error("sglang engine crashed: %s", problem)
        self._cancel_all()

    def _cancel_all(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()

    # ---- coroutines that run on the engine's loop

    async def generate(self, request_id: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``async_generate`` for one request, tracked so that a crash, abort or shutdown can end it.

        sglang's ``rid`` is ``request_id`` plus a counter: the same daskgen request id may be in
        flight twice (e.g. two concurrent health checks), and sglang refuses duplicate rids.
        """
        self._raise_if_unusable()
        rid = f"{request_id}#{next(self._ids)}"
        task = asyncio.ensure_future(self.engine.async_generate(rid=rid, **kwargs))
        self.tasks[rid] = task
        self.rids.setdefault(request_id, set()).add(rid)
        try:
            return await task
        except asyncio.CancelledError:
            self._raise_if_unusable()
            self._abort_now(rid)  # the caller gave up: stop the request inside sglang too
            raise
        finally:
            self.tasks.pop(rid, None)
            self._forget_rid(request_id, rid)

    def _forget_rid(self, request_id: str, rid: str) -> None:
        rids = self.rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self.rids[request_id]

    def _raise_if_unusable(self) -> None:
        if self.closing:
            raise _Closed("the sglang engine was shut down")
        if self.problem is not None:
            raise _Crashed(self.problem)

    async def abort(self, request_id: str) -> None:
        """Abort every in-flight request of ``request_id``, waiting briefly for new ones to register."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ABORT_WAIT
        pending = set(self.rids.get(request_id, ()))
        while pending and self.engine is not None:
            for rid in list(pending):
                if rid not in self.tasks:
                    pending.discard(rid)
                elif rid in self.engine.tokenizer_manager.rid_to_state:
                    self._abort_now(rid)
                    pending.discard(rid)
            if not pending or loop.time() > deadline:
                return
            await asyncio.sleep(0.005)

    def _abort_now(self, rid: str) -> None:
        if self.engine is not None and self.problem is None and not self.closing:
            self.engine.tokenizer_manager.abort_request(rid=rid)

    async def memory(self, release: bool) -> None:
        """Release (``True``) or resume GPU memory occupation."""
        from sglang.srt.managers.io_struct import (
            ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput,
        )

        manager = self.engine.tokenizer_manager
        if release:
            await manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        else:
            await manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)


def _settle(future: concurrent.futures.Future[None], exc: BaseException | None) -> None:
    """Resolve ``future`` unless the caller already cancelled it."""
    try:
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


def _prepare_environment(device: str) -> None:
    """Environment sglang reads at import and passes to its subprocesses."""
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    if _is_cpu(device):
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"


def _child_pids(engine: Any) -> list[int]:
    try:
        return list(engine.get_all_child_pids())
    except Exception:  # an attribute of sglang's internals; the process names suffice
        return []


def _new_sglang_children(before: set[int], known: list[int]) -> list[Any]:
    """Children of this process started by sglang since ``before`` (not Python's helpers)."""
    import psutil

    found = []
    for proc in psutil.Process().children():
        try:
            if proc.pid not in before and (proc.pid in known or proc.name().startswith("sglang")):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def _dead_child(children: list[Any]) -> str | None:
    import psutil

    for proc in children:
        try:
            alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            return f"sglang subprocess {proc.pid} exited"
    return None


def _kill(children: list[Any]) -> None:
    """SIGKILL ``children`` and their descendants and wait for them."""
    import psutil

    victims = []
    for proc in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.extend(proc.children(recursive=True))
        victims.append(proc)
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _, alive = psutil.wait_procs(victims, timeout=_STOP_TIMEOUT)
    if alive:
        logger.warning("sglang processes still alive after SIGKILL: %s", [p.pid for p in alive])


def _stop_watchdog(engine: Any) -> None:
    """Stop sglang's subprocess watchdog so killing the children does not SIGQUIT us."""
    watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
    if watchdog is not None:
        try:
            watchdog.stop()
        except Exception:
            logger.warning("stopping sglang's subprocess watchdog failed", exc_info=True)


def _release(engine: Any) -> None:
    """Drop sglang's atexit hook: it would kill every child of this process at exit."""
    atexit.unregister(engine.shutdown)


def _close_sockets(engine: Any) -> None:
    """Close the ZeroMQ sockets of ``engine`` and its tokenizer manager without lingering.

    With sglang's subprocesses gone, a socket holding unsent messages would make the garbage
    collection of its context (``zmq.Context.term``) block forever, e.g. at interpreter exit.
    """
    if engine is None:
        return
    import zmq

    owners = [engine, getattr(engine, "tokenizer_manager", None)]
    for owner in owners:
        for value in list(vars(owner).values()) if owner is not None else ():
            if isinstance(value, zmq.Socket) and not value.closed:
                try:
                    value.close(linger=0)
                except Exception:
                    logger.debug("closing an sglang socket failed", exc_info=True)


def _drain(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the engine's loop and let it finish."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _engine_info(engine: Any, version: str) -> dict[str, Any]:
    """Model limits and identity read from a launched ``sglang.Engine``."""
    import torch

    config = engine.tokenizer_manager.model_config
    context = int(config.context_len)
    try:  # the scheduler's report (KV pool size, longest prompt); private in sglang 0.5.23
        scheduler = dict(engine._scheduler_init_result.scheduler_infos[0])
    except (AttributeError, IndexError, TypeError):
        scheduler = {}
    eos = getattr(config, "hf_eos_token_id", None) or set()
    return {
        "context_length": context,
        "vocab_size": int(config.vocab_size),
        "max_total_num_tokens": int(scheduler.get("max_total_num_tokens") or context),
        "max_req_input_len": int(scheduler.get("max_req_input_len") or context),
        "eos_token_ids": sorted(int(t) for t in eos),
        "bos_token_id": getattr(getattr(config, "hf_text_config", None), "bos_token_id", None),
        "dtype": str(config.dtype).removeprefix("torch."),
        "sglang_version": version,
        "torch_version": torch.__version__,
    }


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# --------------------------------------------------------------------------- the engine


class SGLangEngine(Engine):
    """daskgen's engine contract on top of one in-process ``sglang.Engine`` (see the module doc).

    Parameters
    ----------
    model:
        Model folder (or name sglang can load; no hub access is assumed).
    **engine_args:
        ``sglang.Engine`` keyword arguments (``ServerArgs`` fields).
    """

    name = "sglang"

    def __init__(self, model: str, **engine_args: Any) -> None:
        super().__init__(model, **engine_args)
        if "model_path" in engine_args:
            raise ConfigError(_MODEL_PATH_ERROR)
        self.supports_seed = bool(engine_args.get("enable_deterministic_inference", False))
        self._state = "new"
        self._backend: _Backend | None = None
        self._kwargs: dict[str, Any] = {}
        self._asleep = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Launch ``sglang.Engine`` in the engine's own thread (~20 s for a tiny model on CPU)."""
        if self._state != "new":
            raise EngineError(f"sglang engine is {self._state}; create a new engine to start again")
        self._check_process()
        self._state = "starting"
        if not install_sigquit_handler():
            logger.warning(
                "sglang engine started off the main thread: cannot install a SIGQUIT handler, so a "
                "crashing sglang subprocess will terminate this process (SIGQUIT's default action)"
            )
        try:
            self._kwargs = launch_kwargs(self.model, self.engine_args, await asyncio.to_thread(_cuda_available))
            backend = _Backend(self._kwargs)
            self._backend = backend
            _BACKENDS.add(backend)
            await asyncio.wrap_future(backend.launch())
        except BaseException as exc:
            self._state = "failed"
            await self._stop_backend()
            if isinstance(exc, Exception) and not isinstance(exc, (ConfigError, EngineError)):
                raise EngineError(f"sglang.Engine({_redacted(self._kwargs)}) failed to start: {exc}") from exc
            raise
        self._state = "running"
        logger.info("sglang engine ready: %s", self._backend.info)

    @staticmethod
    def _check_process() -> None:
        """Refuse to start in a daemonic process: sglang must start subprocesses."""
        if multiprocessing.current_process().daemon:
            raise EngineError(
                "the sglang engine must start subprocesses, but this process is daemonic and daemonic "
                "processes may not have children (Dask starts worker processes as daemons by default). "
                f"Fix: {DAEMON_FIX}."
            )

    async def shutdown(self) -> None:
        """Stop the engine's thread and kill the processes it launched (idempotent)."""
        self._state = "closed"
        await self._stop_backend()

    async def _stop_backend(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            await asyncio.to_thread(backend.stop)
        _restore_sigquit_handler()

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample; errors come back in ``GenerationResult.error``."""
        problem = self._not_serving() or request_error(
            request, vocab_size=self._info("vocab_size"), max_total_tokens=self.max_total_tokens
        ) or self._prompt_too_long(request)
        if problem is not None:
            return error_result(request, problem)
        kwargs = {
            "input_ids": list(request.prompt_ids),
            "sampling_params": sampling_params_for(request.params),
            "return_logprob": request.params.logprobs,
        }
        return await self._run(request, kwargs)

    async def _run(self, request: GenerationRequest, kwargs: dict[str, Any]) -> GenerationResult:
        backend = self._backend
        try:
            future = backend.submit(backend.generate(request.request_id, kwargs))
            output = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            raise  # wrap_future has cancelled the submission; the backend aborts the request
        except _Closed:
            return GenerationResult(request.request_id, [], FinishReason.ABORT)
        except _Crashed as exc:
            return error_result(request, f"sglang engine crashed: {exc}")
        except Exception as exc:  # sglang rejects some requests by raising (e.g. ValueError)
            return error_result(request, f"sglang rejected the request: {type(exc).__name__}: {exc}")
        return result_from_output(request, output)

    def _not_serving(self) -> str | None:
        if self._state != "running" or self._backend is None:
            return f"sglang engine is {self._state}, not running"
        if self._backend.problem is not None:
            return f"sglang engine crashed: {self._backend.problem}"
        if self._asleep:
            return "sglang engine is asleep (its memory is released); call wake() first"
        return None

    def _prompt_too_long(self, request: GenerationRequest) -> str | None:
        limit = self._info("max_req_input_len")
        if limit is not None and len(request.prompt_ids) > limit:
            return (f"request {request.request_id!r}: prompt has {len(request.prompt_ids)} tokens; "
                    f"sglang accepts at most {limit}")
        return None

    async def abort(self, request_id: str) -> None:
        """End the request; its ``generate`` returns ``ABORT`` with the tokens so far."""
        backend = self._backend
        if backend is None or self._state != "running":
            return
        with contextlib.suppress(_Closed):
            await asyncio.wrap_future(backend.submit(backend.abort(request_id)))

    # ------------------------------------------------------------------ health, memory, identity

    async def health(self) -> None:
        """Raise unless the subprocesses are alive and the engine really generates a token."""
        problem = self._not_serving()
        if problem is not None:
            raise EngineError(problem)
        await super().health()

    def health_token_id(self) -> int:
        """The model's BOS token (or 0)."""
        bos = self._info("bos_token_id")
        vocab = self._info("vocab_size") or 1
        return bos if isinstance(bos, int) and 0 <= bos < vocab else 0

    @property
    def sleep_supported(self) -> bool:
        """True when :meth:`sleep` really releases memory (CUDA with ``enable_memory_saver``)."""
        return not _is_cpu(self._kwargs.get("device", "cpu")) and bool(self._kwargs.get("enable_memory_saver"))

    async def sleep(self) -> None:
        """Release GPU memory (weights, KV cache) while idle; no-op where unsupported."""
        await self._set_memory(release=True)

    async def wake(self) -> None:
        """Resume the memory released by :meth:`sleep`."""
        await self._set_memory(release=False)

    async def _set_memory(self, release: bool) -> None:
        if not self.sleep_supported or release == self._asleep:
            return
        problem = self._not_serving() if release else None
        if problem is not None:
            raise EngineError(problem)
        if release and self._backend.tasks:
            raise EngineError(f"sglang engine has {len(self._backend.tasks)} requests in flight; sleep needs it idle")
        backend = self._backend
        await asyncio.wrap_future(backend.submit(backend.memory(release)))
        self._asleep = release

    def _info(self, key: str) -> Any:
        return self._backend.info.get(key) if self._backend is not None else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every request (the model's EOS ids); known after :meth:`start`."""
        return frozenset(self._info("eos_token_ids") or ())

    @property
    def max_total_tokens(self) -> int | None:
        """Largest prompt plus ``max_new_tokens`` of one request; known after :meth:`start`."""
        context, pool = self._info("context_length"), self._info("max_total_num_tokens")
        return None if context is None else min(context, pool or context)

    @property
    def capacity(self) -> int | None:
        """``max_running_requests`` when given in ``engine_args`` (sglang sizes it from its KV pool otherwise)."""
        value = self.engine_args.get("max_running_requests")
        return int(value) if isinstance(value, int) and value > 0 else None

    def describe(self) -> dict[str, Any]:
        """Engine, model, the ``sglang.Engine`` options used and the model's identity."""
        info = super().describe()
        info["model"] = self.model
        info["supports_seed"] = self.supports_seed
        info["engine_args"] = _redacted(self._kwargs or self.engine_args)
        if self._backend is not None:
            info.update(self._backend.info)
        return info
