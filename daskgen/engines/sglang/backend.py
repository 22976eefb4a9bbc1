"""Launching and owning the in-process ``sglang.Engine`` behind :class:`~daskgen.engines.sglang.SGLangEngine`.

:mod:`daskgen.engines.sglang.engine` is the engine (its docstring explains the design); this
module holds the machinery underneath:

* :class:`SGLangBackend`: the ``sglang.Engine`` created on, and driven from, its own thread and
  event loop (``daskgen-sglang``, a :class:`~daskgen.engines.inprocess.LoopThread`), the monitor
  of sglang's subprocesses, request bookkeeping (rids, abort), and a shutdown that kills exactly
  the processes this engine launched, removes the load-report file they leave in ``/dev/shm``
  (:mod:`daskgen.engines.leftovers`), stops sglang's watchdog, closes its ZeroMQ sockets and
  removes its ``atexit`` hook;
* :class:`BackendClosed` and :class:`BackendCrashed`, what a request on a stopped or crashed
  backend raises.

The process-wide ``SIGQUIT`` handler and the registry of live backends it checks are in
:mod:`daskgen.engines.sglang.sigquit`.  Heavy imports (sglang, torch, psutil, zmq) happen inside
functions only.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from daskgen import tunables
from daskgen.engines.inprocess import LoopThread, root_logging_kept
from daskgen.engines.leftovers import SGLANG_LOADS, SHARED_MEMORY, held_files, remove_files
from daskgen.engines.sglang.args import check_engine_args, is_cpu_device
from daskgen.engines.sglang.mapping import max_running_requests
from daskgen.engines.sglang.sigquit import register, unregister

__all__ = ["BackendClosed", "BackendCrashed", "SGLangBackend", "read_max_running_requests"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# --------------------------------------------------------------------------- the engine's thread


class BackendCrashed(Exception):
    """The sglang engine's subprocesses died."""


class BackendClosed(Exception):
    """The engine was shut down while the request was in flight."""


class SGLangBackend:
    """A ``sglang.Engine`` plus the thread and event loop that own it."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self.engine: Any = None
        self.problem: str | None = None
        self.closing = False
        self.info: dict[str, Any] = {}
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self.rids: dict[str, set[str]] = {}
        self._ids = itertools.count()
        self._children: list[Any] = []
        self._submitted: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        self.runner = LoopThread("daskgen-sglang", setup=self._setup, teardown=self._teardown)

    # ---- lifecycle (called from outside the engine's thread)

    def launch(self) -> concurrent.futures.Future[None]:
        """Start the thread; the future resolves once ``sglang.Engine`` is up.

        The backend is registered for the ``SIGQUIT`` crash check until :meth:`stop`.
        """
        register(self)
        return self.runner.start()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Run ``coro`` on the engine's loop; shutdown resolves it with :class:`BackendClosed` if it never ran."""
        with self._lock:
            if self.closing or self.runner.loop.is_closed():
                coro.close()
                raise BackendClosed("the sglang engine is shut down")
            future = self.runner.submit(coro)
            self._submitted.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._submitted.discard(future)

    def poke(self) -> None:
        """Ask the monitor to check the subprocesses now (thread- and signal-safe enough)."""
        self.runner.call_soon(self._check_children)

    def stop(self) -> None:
        """Blocking: stop the loop and thread, kill exactly this engine's processes."""
        with self._lock:
            self.closing = True
        unregister(self)
        if self.runner.thread.is_alive():
            concurrent.futures.wait([self.runner.ready], tunables.seconds("sglang.launch-wait"))
        engine = self.engine
        if engine is not None:
            _stop_watchdog(engine)
        self.runner.call_soon(self._cancel_all)
        self.runner.stop(tunables.seconds("sglang.stop-timeout"))
        self._fail_unstarted()
        remove_files(_loads_files(engine, self._children), "the sglang engine")  # its processes are killed next
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
                future.set_exception(BackendClosed("the sglang engine was shut down"))

    # ---- the engine's thread

    def _setup(self) -> None:
        """On the engine's thread, before its loop runs: create ``sglang.Engine``, start the monitor."""
        self._create_engine()
        self.runner.loop.create_task(self._monitor())

    def _teardown(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine's thread, after its loop stopped (or the launch failed)."""
        _drain(loop)  # cancels sglang's own tasks too, before their sockets close under them
        _close_sockets(self.engine)

    def _create_engine(self) -> None:
        import psutil

        _prepare_environment(self.kwargs["device"])
        import sglang

        check_engine_args({k: v for k, v in self.kwargs.items() if k != "model_path"})
        before = {p.pid for p in psutil.Process().children()}
        try:
            with root_logging_kept():
                self.engine = sglang.Engine(**self.kwargs)
        except BaseException:
            _kill(_new_sglang_children(before, []))
            raise
        self._children = _new_sglang_children(before, _child_pids(self.engine))
        self.info = _engine_info(self.engine, sglang.__version__)

    async def _monitor(self) -> None:
        while self.problem is None:
            await asyncio.sleep(tunables.seconds("sglang.monitor-interval"))
            self._check_children()

    @property
    def children(self) -> list[Any]:
        """The sglang subprocesses this backend started (``psutil.Process``), killed at shutdown."""
        return list(self._children)

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
        rid = f"{request_id}#{next(self._ids)}"
        self.rids.setdefault(request_id, set()).add(rid)
        try:  # a caller that gives up stops the request inside sglang too
            abort = functools.partial(self._abort_now, rid)
            return await self._tracked(rid, lambda engine: engine.async_generate(rid=rid, **kwargs), abort)
        finally:
            self._forget_rid(request_id, rid)

    async def run_native(self, work: Callable[[Any], Coroutine[Any, Any, _T]]) -> _T:
        """``work(engine)``: a caller's own calls on the ``sglang.Engine``, tracked as requests are (a crash or
        shutdown ends it with the same errors)."""
        return await self._tracked(f"native#{next(self._ids)}", work)

    async def _tracked(
        self, key: str, work: Callable[[Any], Coroutine[Any, Any, _T]], on_cancel: Callable[[], None] | None = None
    ) -> _T:
        """``work(engine)`` as a task in :attr:`tasks` under ``key``, which a crash or shutdown cancels; a caller's
        cancellation runs ``on_cancel`` (when the engine is still usable) and propagates."""
        self._raise_if_unusable()
        self.tasks[key] = task = asyncio.ensure_future(work(self.engine))
        try:
            return await task
        except asyncio.CancelledError:
            self._raise_if_unusable()
            if on_cancel is not None:
                on_cancel()
            raise
        finally:
            self.tasks.pop(key, None)

    def _forget_rid(self, request_id: str, rid: str) -> None:
        rids = self.rids.get(request_id)
        if rids is not None:
            rids.discard(rid)
            if not rids:
                del self.rids[request_id]

    def _raise_if_unusable(self) -> None:
        if self.closing:
            raise BackendClosed("the sglang engine was shut down")
        if self.problem is not None:
            raise BackendCrashed(self.problem)

    async def abort(self, request_id: str) -> None:
        """Abort every in-flight request of ``request_id``, waiting briefly for new ones to register."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + tunables.seconds("sglang.abort-wait")
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

    async def update_weights(self, path: str) -> tuple[bool, str]:
        """Load the checkpoint in ``path`` into the running model (sglang's update from disk; it rolls back to the
        weights it had when the load fails); ``(success, message)``."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        found = await self.engine.tokenizer_manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path=path), None
        )
        return bool(found[0]), str(found[1])

    async def weights(self, name: str, rows: int) -> Any:
        """The parameter ``name`` as sglang returns it (float32 values of its first ``rows`` rows, or ``None``)."""
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        request = GetWeightsByNameReqInput(name=name, truncate_size=rows)
        return await self.engine.tokenizer_manager.get_weights_by_name(request, None)

    async def flush_cache(self, timeout_s: float) -> bool:
        """Drop sglang's prefix cache once no request runs, waiting up to ``timeout_s`` for them; whether it did."""
        return bool((await self.engine.tokenizer_manager.flush_cache(timeout_s=timeout_s)).success)


def _prepare_environment(device: str) -> None:
    """Environment sglang reads at import and passes to its subprocesses."""
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    if is_cpu_device(device):
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
    _, alive = psutil.wait_procs(victims, timeout=tunables.seconds("sglang.stop-timeout"))
    if alive:
        logger.warning("sglang processes still alive after SIGKILL: %s", [p.pid for p in alive])


def _loads_files(engine: Any, children: list[Any]) -> set[Path]:
    """The load-report files of this engine in the shared-memory folder: those its processes hold open, and the
    one sglang names after the engine's instance (``port_args.instance_id``), removed once they are gone."""
    import psutil

    pids = [proc.pid for proc in children]
    for proc in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            pids.extend(child.pid for child in proc.children(recursive=True))
    found = held_files(pids, SHARED_MEMORY, SGLANG_LOADS)
    instance = getattr(getattr(engine, "port_args", None), "instance_id", None)
    if instance:
        with contextlib.suppress(ImportError):
            from sglang.srt.managers.load_snapshot import shm_path_for

            found.add(Path(shm_path_for(instance)))
    return found


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
        "torch_version": str(torch.__version__),
    }


async def read_max_running_requests(backend: SGLangBackend, timeout_s: float = 60.0) -> int | None:
    """Requests the scheduler runs at once (sized from its KV pool unless set), or ``None``.

    Asked on the engine's running loop from the scheduler's internal state
    (``effective_max_running_requests_per_dp`` times the data-parallel size, sglang 0.5.23).
    """
    try:
        future = backend.submit(backend.engine.tokenizer_manager.get_internal_state())
        states = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        return max_running_requests(states[0])
    except Exception as exc:  # another sglang version, or no answer: window auto assumes a default
        logger.info("sglang did not report max_running_requests (%s: %s)", type(exc).__name__, exc)
        return None
