"""What the in-process engines (``transformers``, ``sglang``, ``vllm``) share, written once.

* :class:`InProcessEngine`: the engine base for a backend that lives inside the worker process:
  start failures wrapped as :class:`~daskgen.errors.EngineError` naming the backend, the
  refusal of requests (not running, crashed, asleep, invalid), the health check's prompt token,
  sleep/wake (only when :attr:`~daskgen.engines.base.Engine.sleep_supported`, only when idle),
  ``describe()`` from the backend's identity (:attr:`InProcessEngine.info`), aborts run on the
  backend's loop (:meth:`InProcessEngine.abort_on_loop`), and the refusal to start subprocesses in
  a daemonic process (:data:`DAEMON_FIX`).
* :class:`LoopThread`: an asyncio event loop owned by a daemon thread of its own, for backends
  that must not run on (or stall) the Dask worker's loop; callers submit coroutines to it and
  await them with :func:`asyncio.wrap_future`.
* :func:`cuda_available`: whether torch sees a CUDA device, which picks the backends' device defaults.
* :func:`root_logging_kept`: the process's root logger as it was, around a backend's launch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

from daskgen.engines.base import Engine, EngineStatus, GenerationRequest
from daskgen.engines.request_check import request_error
from daskgen.errors import ConfigError, EngineError

__all__ = ["DAEMON_FIX", "InProcessEngine", "LoopClosed", "LoopThread", "cuda_available", "root_logging_kept"]

_T = TypeVar("_T")

#: How the Dask fix for daemonic worker processes is spelled, for error messages and docs.
DAEMON_FIX = (
    "set the Dask config `distributed.worker.daemon: false` before the cluster starts its workers "
    "(e.g. `dask.config.set({'distributed.worker.daemon': False})` before creating a LocalCluster, "
    "`DASK_DISTRIBUTED__WORKER__DAEMON=False` in the environment of `dask worker`/dask-jobqueue jobs), "
    "or run workers without a nanny (`dask worker --no-nanny`)"
)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; ``False`` when torch is not installed (imports torch)."""
    from importlib.util import find_spec

    if find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


class LoopClosed(RuntimeError):
    """A coroutine was submitted to a :class:`LoopThread` that is stopped."""


class LoopThread:
    """An asyncio event loop owned by a daemon thread named ``name``, for one backend.

    :meth:`start` starts the thread, which makes the loop its current one, runs ``setup`` (a
    blocking callable: e.g. a backend that must be created on the thread of its loop), then runs
    the loop until :meth:`stop`.  After the loop stops (or ``setup`` raised), ``teardown(loop)``
    runs on the thread and the loop is closed.  :meth:`submit` runs coroutines on the loop from
    any thread.
    """

    def __init__(
        self,
        name: str,
        setup: Callable[[], None] | None = None,
        teardown: Callable[[asyncio.AbstractEventLoop], None] | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        #: Resolved once ``setup`` ran (with its exception, if it raised).
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._setup, self._teardown = setup, teardown

    def start(self) -> concurrent.futures.Future[None]:
        """Start the thread; the returned future (:attr:`ready`) resolves once ``setup`` ran."""
        self.thread.start()
        return self.ready

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as exc:
            self._finish()
            _settle(self.ready, exc)
            return
        _settle(self.ready, None)
        try:
            self.loop.run_forever()
        finally:
            self._finish()

    def _finish(self) -> None:
        try:
            if self._teardown is not None:
                self._teardown(self.loop)
        finally:
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the loop; raise :class:`LoopClosed` when the loop is closed."""
        if self.loop.is_closed():
            coro.close()
            raise LoopClosed(f"the event loop of thread {self.thread.name!r} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` on the loop soon (from any thread); nothing when the loop is closed."""
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self.loop.call_soon_threadsafe(callback)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Blocking: stop the loop and join the thread (idempotent); teardown runs on the thread."""
        if self.thread.ident is None:  # never started
            if not self.loop.is_closed():
                self.loop.close()
            return
        self.call_soon(self.loop.stop)
        self.thread.join(timeout=timeout_s)


def _settle(future: concurrent.futures.Future[None], exc: BaseException | None) -> None:
    """Resolve ``future`` unless the caller already cancelled it."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)


class _Submits(Protocol):
    """What runs coroutines on a backend's loop (a :class:`LoopThread`, or a backend wrapping one)."""

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]: ...


_OwnerT = TypeVar("_OwnerT", bound=_Submits)


class InProcessEngine(Engine):
    """Base of the engines whose backend runs inside the worker process (see the module docstring).

    A subclass implements :meth:`~daskgen.engines.base.Engine.load`/``unload``, ``generate`` and
    ``abort``, and, where they apply, the hooks :meth:`~daskgen.engines.base.Engine.crash`,
    :meth:`requests_in_flight` and
    :meth:`set_memory`.  It fills :attr:`info` with the backend's identity when it loads.
    """

    #: True when the backend starts subprocesses (so it cannot run in a daemonic process).
    starts_subprocesses = False

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **engine_args: Any) -> None:
        super().__init__(model, **engine_args)
        self.info: dict[str, Any] = {}
        self.asleep = False
        #: The LoRA adapters (name -> folder) the engine loads, for engines with the ``lora`` feature.
        self.adapters: dict[str, str] = dict(adapters or {})
        if self.adapters and "lora" not in self.features:
            raise ConfigError(
                f"the {self.name} engine does not serve LoRA adapters; drop 'adapters' or use another engine"
            )

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start once (see :meth:`Engine.start`); failures other than config errors become ``EngineError``."""
        if self.starts_subprocesses and multiprocessing.current_process().daemon:
            raise EngineError(
                f"the {self.name} engine must start subprocesses, but this process is daemonic and daemonic "
                "processes may not have children (Dask starts worker processes as daemons by default). "
                f"Fix: {DAEMON_FIX}."
            )
        try:
            await super().start()
        except (ConfigError, EngineError):
            raise
        except Exception as exc:
            raise EngineError(f"{self.launch_description()} failed to start: {type(exc).__name__}: {exc}") from exc

    def launch_description(self) -> str:
        """What was launched, for start errors (no secrets)."""
        return f"{self.name} engine for {self.model!r}"

    # ------------------------------------------------------------------ serving

    def not_serving(self) -> str | None:
        """Not running, crashed, or asleep: why requests are refused now (``None`` when serving)."""
        problem = super().not_serving()
        if problem is not None:
            return problem
        crash = self.crash()
        if crash is not None:
            return f"{self.name} engine crashed: {crash}"
        if self.asleep:
            return f"{self.name} engine is asleep (its memory is released); call wake() first"
        return None

    def refusal(self, request: GenerationRequest) -> str | None:
        """Why ``request`` is refused before it reaches the backend, or ``None``."""
        return self.not_serving() or request_error(
            request, vocab_size=self.vocab_size, max_total_tokens=self.max_total_tokens, adapters=self.adapters
        )

    def health_token_id(self) -> int:
        """The model's BOS token when it is inside the vocabulary, else 0."""
        bos, vocab = self.info.get("bos_token_id"), self.vocab_size or 1
        return bos if isinstance(bos, int) and 0 <= bos < vocab else 0

    async def abort_on_loop(
        self,
        owner: _OwnerT | None,
        call: Callable[[_OwnerT], Coroutine[Any, Any, Any]],
        ignore: type[Exception],
    ) -> None:
        """Run the abort ``call(owner)`` on ``owner``'s loop and await it; nothing unless the engine runs.

        An abort that arrives before start or after shutdown has nothing to stop; exceptions of type
        ``ignore`` (a backend closing meanwhile) are dropped.
        """
        if owner is None or self.status is not EngineStatus.RUNNING:
            return
        with contextlib.suppress(ignore):
            await asyncio.wrap_future(owner.submit(call(owner)))

    # ------------------------------------------------------------------ sleep and wake

    def requests_in_flight(self) -> int:
        """Hook: requests the backend is working on (sleep needs none)."""
        return 0

    async def set_memory(self, release: bool) -> None:
        """Hook: release (``True``) or resume accelerator memory; only called when ``sleep_supported``."""
        raise NotImplementedError(f"{self.name} engine cannot release its memory")

    async def sleep(self) -> None:
        """Release accelerator memory while idle; a no-op unless ``sleep_supported``."""
        await self._switch_memory(release=True)

    async def wake(self) -> None:
        """Undo :meth:`sleep`."""
        await self._switch_memory(release=False)

    async def _switch_memory(self, release: bool) -> None:
        if not self.sleep_supported or release == self.asleep:
            return
        problem = self.not_serving() if release else None
        if problem is not None:
            raise EngineError(problem)
        busy = self.requests_in_flight()
        if release and busy:
            raise EngineError(f"{self.name} engine has {busy} requests in flight; sleep needs it idle")
        await self.set_memory(release)
        self.asleep = release

    # ------------------------------------------------------------------ identity

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end every request (the model's EOS ids, from :attr:`info`); known after :meth:`start`."""
        return frozenset(self.info.get("eos_token_ids") or ())

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (from :attr:`info`); known after :meth:`start`."""
        return self.info.get("vocab_size")

    def describe(self) -> dict[str, Any]:
        """Engine, model, the options used and the backend's identity (:attr:`info`)."""
        described = super().describe()
        described.update(model=self.model, supports_seed=self.supports_seed, engine_args=self.described_args())
        described.update(self.info)
        return described

    def described_args(self) -> dict[str, Any]:
        """The engine options recorded by :meth:`describe` (no secrets)."""
        return dict(self.engine_args)


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Restore the root logger's level and handlers after a backend's launch that reconfigures them (sglang's
    calls ``logging.basicConfig(force=True)`` at its log level, ERROR by default): else the worker's own records
    below that level, daskgen's warnings among them, never reach the worker's log again."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        for handler in [h for h in handlers if h not in root.handlers]:
            root.addHandler(handler)
        root.setLevel(level)
