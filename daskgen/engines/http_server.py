"""HTTP plumbing of the ``openai`` engine: a retrying client and a managed SGLang server.

:class:`HTTPClient` sends JSON and streaming (SSE) requests with retries on 429, 5xx and
connection errors (``tenacity``: exponential backoff with jitter, ``Retry-After`` honoured) and
turns failures into messages that never contain the API key.

:class:`ManagedServer` is one ``python -m sglang.launch_server`` subprocess per engine, used by
the ``openai`` engine with ``managed=True``.  :class:`ManagedServer` picks a free
loopback port, starts the server in its own process group (so that stopping it also stops
the scheduler and detokenizer processes it spawns), waits until ``/health_generate`` answers
200, and stops the whole group on :meth:`~ManagedServer.stop`.  The server's output goes to a
log file whose last lines are quoted by every error, so a failed launch says why.

A server subprocess (unlike an in-process ``sglang.Engine``) also starts from a daemonic Dask
worker process: ``subprocess`` is allowed where ``multiprocessing`` children are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from daskgen.engines.common import cuda_available
from daskgen.errors import ConfigError, EngineError
from daskgen.redaction import redact_url

try:
    import httpx
    import tenacity
except ModuleNotFoundError as _missing:  # an optional extra; the engine says how to install it
    httpx = tenacity = None  # type: ignore[assignment]
    MISSING_HTTP = _missing.name
else:
    MISSING_HTTP = None

__all__ = ["HTTPClient", "ManagedServer", "RequestFailed", "free_port", "redact_url", "server_flags",
           "require_http", "split_base_url", "stream_events"]

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: ``server_args`` keys refused because their values are secrets (they would show in ``ps``).
SECRET_SERVER_ARGS = ("api_key", "admin_api_key")
_POLL_S = 1.0
#: Seconds sglang gets to exit on SIGTERM, then to have no process left after SIGKILL.
_STOP_GRACE_S = 5.0
_TAIL_LINES = 30

# --------------------------------------------------------------------------- HTTP client

_EXCERPT = 300
_CONNECT_TIMEOUT_S = 10.0
_MAX_WAIT_S = 60.0
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RequestFailed(Exception):
    """A request failed for good (after any retries); the message holds no secret."""


class StatusFailure(RequestFailed):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status: int, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def require_http() -> None:
    """Raise :class:`EngineError` with the install hint when ``httpx`` or ``tenacity`` is missing."""
    if MISSING_HTTP is not None:
        raise EngineError(f"the openai engine needs the package {MISSING_HTTP!r}: pip install 'daskgen[http]'")


def split_base_url(base_url: str) -> tuple[str, str]:
    """``(root, openai_base)``: ``http://h:1/v1`` and ``http://h:1`` both give ``("http://h:1", "http://h:1/v1")``."""
    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    return root, root + "/v1"


async def stream_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent-event stream (``data: {...}`` lines) up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def _transient(exc: BaseException) -> bool:
    """429, 5xx-style statuses and transport errors (refused, reset, timed out) are worth retrying."""
    if isinstance(exc, StatusFailure):
        return exc.status in _TRANSIENT_STATUS
    return isinstance(exc, httpx.TransportError)


def _retry_after(response: httpx.Response) -> float | None:
    with contextlib.suppress(TypeError, ValueError):
        return min(_MAX_WAIT_S, max(0.0, float(response.headers.get("retry-after"))))
    return None


class HTTPClient:
    """JSON and SSE requests to one server, with retries; failures raise :class:`RequestFailed`.

    Parameters
    ----------
    base_url:
        The server (``/v1`` paths go to its OpenAI base, others to its root).
    api_key_env:
        Name of the environment variable holding the API key (sent as a bearer token).
    timeout_s, max_connections, max_retries, backoff_s:
        Read timeout, connection pool size, retries per request and the first backoff.
    on_retry:
        Called as ``on_retry(what_failed, retry_number, wait_s)`` before each retry.
    give_up:
        Called before each retry; ``True`` stops retrying (e.g. the managed server has died).
    trust_env:
        Use proxy settings from the environment (off for loopback servers).
    """

    def __init__(self, base_url: str, *, api_key_env: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 128, max_retries: int = 3, backoff_s: float = 0.5,
                 on_retry: Callable[[str, int, float], None] | None = None,
                 give_up: Callable[[], bool] = lambda: False, trust_env: bool = True) -> None:
        require_http()
        self.root, self.openai_base = split_base_url(base_url)
        self.where = redact_url(self.root)
        self.api_key_env, self.timeout_s = api_key_env, timeout_s
        self._secret = self._read_key(api_key_env)
        self.max_retries, self.on_retry, self.give_up = max_retries, on_retry, give_up
        self._backoff = (tenacity.wait_exponential(multiplier=backoff_s, max=_MAX_WAIT_S)
                         + tenacity.wait_random(0, backoff_s))
        headers = {"Authorization": f"Bearer {self._secret}"} if self._secret else {}
        self._client = httpx.AsyncClient(
            headers=headers, trust_env=trust_env,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, _CONNECT_TIMEOUT_S)),
            limits=httpx.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections))

    @staticmethod
    def _read_key(name: str | None) -> str | None:
        if name is None:
            return None
        key = os.environ.get(name, "")
        if not key.strip():
            raise EngineError(f"the environment variable {name} (api_key_env) is not set or empty; "
                              f"export the API key in it on every worker")
        return key.strip()

    def url(self, path: str) -> str:
        """Absolute URL of ``path`` (``/v1/...`` relative to the OpenAI base)."""
        return self.openai_base + path[3:] if path.startswith("/v1/") else self.root + path

    def redact(self, text: str) -> str:
        """``text`` with the API key (should a server echo it) replaced by ``***``."""
        return text.replace(self._secret, "***") if self._secret else text

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    # ------------------------------------------------------------------ messages

    def unreachable(self, exc: BaseException) -> str:
        """Why the server could not be reached, and what to check."""
        detail = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
        return self.redact(f"cannot reach the server at {self.where} ({detail}). "
                           "Check that it is running and listening there, that base_url has the right scheme, "
                           "host and port, and that this worker can reach it (firewall, proxy settings)")

    def status_message(self, what: str, response: httpx.Response) -> str:
        """Message for an error status (API-key problems explained)."""
        if response.status_code in (401, 403):
            hint = (f"check the key in the environment variable {self.api_key_env}" if self.api_key_env
                    else "the server needs an API key: set api_key_env to the name of the variable holding it")
            return f"{what} on {self.where}: HTTP {response.status_code}, the server refused the request; {hint}"
        body = response.text.strip().replace("\n", " ")[:_EXCERPT]
        return self.redact(f"{what} on {self.where}: HTTP {response.status_code}: {body}")

    # ------------------------------------------------------------------ requests

    async def probe_json(self, path: str, allow_status: tuple[int, ...] = ()) -> tuple[int, Any]:
        """``GET path`` once, for start-up checks: ``(status, json or None)``; problems raise EngineError."""
        try:
            response = await self._client.get(self.url(path))
        except httpx.HTTPError as exc:
            raise EngineError(self.unreachable(exc)) from None
        if response.status_code == 200:
            with contextlib.suppress(ValueError):
                return 200, response.json()
            return 200, None
        if response.status_code in allow_status:
            return response.status_code, None
        raise EngineError(self.status_message(f"GET {path}", response))

    async def post_json(self, path: str, body: dict[str, Any], retry: bool = True) -> Any:
        """``POST`` ``body`` and return the JSON answer."""

        async def attempt() -> Any:
            response = await self._client.post(self.url(path), json=body)
            self._raise_for_status(f"POST {path}", response)
            return response.json()

        return await self._with_retries(f"POST {path}", attempt, retry)

    async def stream(self, path: str, body: dict[str, Any], on_event: Callable[[dict[str, Any]], str | None],
                     on_attempt: Callable[[], None] = lambda: None, retry: bool = True) -> str | None:
        """``POST`` a streaming request; feed each event to ``on_event``; return the last finish reason.

        ``on_attempt`` runs before every attempt (a retry starts over).  A server that answers
        with plain JSON instead of a stream is handled as a single event.
        """
        what = f"POST {path}"

        async def attempt() -> str | None:
            on_attempt()
            async with self._client.stream("POST", self.url(path), json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._raise_for_status(what, response)
                if response.headers.get("content-type", "").startswith("application/json"):
                    await response.aread()
                    return self._event(what, response.json(), on_event)
                finish = None
                async for event in stream_events(response):
                    finish = self._event(what, event, on_event) or finish
                return finish

        return await self._with_retries(what, attempt, retry)

    def _event(self, what: str, event: Any, on_event: Callable[[dict[str, Any]], str | None]) -> str | None:
        if not isinstance(event, dict):
            raise RequestFailed(self.redact(f"{what} on {self.where}: unexpected event {str(event)[:_EXCERPT]}"))
        if event.get("error"):
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise RequestFailed(self.redact(f"{what} on {self.where}: the server reported: {str(message)[:_EXCERPT]}"))
        return on_event(event)

    def _raise_for_status(self, what: str, response: httpx.Response) -> None:
        if response.status_code != 200:
            raise StatusFailure(self.status_message(what, response), response.status_code, _retry_after(response))

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[Any]], retry: bool) -> Any:
        retries = self.max_retries if retry else 0
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(retries + 1), wait=self._wait, reraise=True,
            retry=tenacity.retry_if_exception(lambda exc: _transient(exc) and not self.give_up()),
            before_sleep=self._before_sleep(what))
        try:
            return await retrying(attempt)
        except StatusFailure as exc:
            raise RequestFailed(f"{exc} ({retrying.statistics.get('attempt_number', 1)} attempts)") from None
        except httpx.HTTPError as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                raise RequestFailed(f"{what} on {self.where}: the server sent nothing for {self.timeout_s} s "
                                    f"(timeout_s; {type(exc).__name__}) ({attempts} attempts)") from None
            raise RequestFailed(f"{what}: {self.unreachable(exc)} ({attempts} attempts)") from None
        except (ValueError, KeyError) as exc:  # a malformed answer
            raise RequestFailed(self.redact(f"{what} on {self.where}: malformed answer ({exc})")) from None

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """Exponential backoff with jitter, or the server's ``Retry-After`` when that is longer."""
        server = getattr(state.outcome.exception(), "retry_after", None) if state.outcome else None
        return min(_MAX_WAIT_S, max(server or 0.0, self._backoff(state)))

    def _before_sleep(self, what: str) -> Callable[[tenacity.RetryCallState], None]:
        def log(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            reason = str(exc) if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {exc}"
            if self.on_retry is not None:
                wait = state.next_action.sleep if state.next_action else 0.0
                self.on_retry(self.redact(f"{what} failed ({reason})"), state.attempt_number, wait)

        return log


# --------------------------------------------------------------------------- the managed server


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_flags(kwargs: Mapping[str, Any]) -> list[str]:
    """``launch_server`` command-line flags for ``kwargs``: ``{"tp_size": 2}`` -> ``--tp-size 2``.

    ``True`` becomes a bare flag, ``False`` and ``None`` are left out, lists give one value
    per item and dicts are passed as JSON.
    """
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def check_server_args(server_args: Mapping[str, Any]) -> None:
    """Refuse options daskgen sets itself (model, host, port) and secrets."""
    own = sorted(set(server_args) & {"model_path", "host", "port"})
    if own:
        raise ConfigError(f"openai engine: server_args must not set {own}; daskgen sets the model (its `model`), "
                          f"host ({LOOPBACK}) and a free port itself")
    secret = sorted(set(server_args) & set(SECRET_SERVER_ARGS))
    if secret:
        raise ConfigError(f"openai engine: server_args must not contain {secret}: a managed server listens on "
                          f"{LOOPBACK} only and its command line is visible to every local user")


class ManagedServer:
    """One sglang HTTP server subprocess on a free loopback port.

    Parameters
    ----------
    model:
        Model folder or name given to ``--model-path``.
    server_args:
        Further ``launch_server`` options (``ServerArgs`` field names, e.g. ``{"tp_size": 2}``).
        On a machine without CUDA the sglang engine's CPU defaults fill in what is unset.
    start_timeout_s:
        How long :meth:`start` waits for the server to answer ``/health_generate``.
    python:
        The interpreter that runs sglang (default: this one).
    """

    def __init__(self, model: str, server_args: Mapping[str, Any] | None = None, *,
                 start_timeout_s: float = 600.0, python: str | None = None) -> None:
        self.model = model
        self.server_args = dict(server_args or {})
        check_server_args(self.server_args)
        self.start_timeout_s = start_timeout_s
        self.python = python or sys.executable
        self.port: int | None = None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.healthy = False

    @property
    def url(self) -> str:
        """Base URL of the running server (``http://127.0.0.1:PORT``)."""
        return f"http://{LOOPBACK}:{self.port}"

    def command(self, port: int, cuda_available: bool) -> list[str]:
        """The ``launch_server`` command line for ``port``."""
        from daskgen.engines.sglang import launch_kwargs

        kwargs = launch_kwargs(self.model, self.server_args, cuda_available)
        kwargs.update(host=LOOPBACK, port=port)
        return [self.python, "-m", "sglang.launch_server", *server_flags(kwargs)]

    @property
    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.process is not None and self.process.poll() is None

    async def start(self) -> None:
        """Launch the server and wait until it generates; raise :class:`EngineError` otherwise."""
        require_http()
        self.port, self.healthy = free_port(), False
        command = self.command(self.port, await asyncio.to_thread(cuda_available))
        fd, name = tempfile.mkstemp(prefix="daskgen-sglang-server-", suffix=".log")
        self.log_path = Path(name)
        with os.fdopen(fd, "wb") as log:  # Popen on the calling (event loop) thread: see _die_with_parent
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env=server_env(),
                                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        logger.info("started sglang server pid %d on %s (log %s)", self.process.pid, self.url, self.log_path)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        self.healthy = True

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0)) as client:
            while True:
                if not self.alive:
                    raise EngineError(f"the managed sglang server {self.exit_description()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health_generate")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise EngineError(f"the managed sglang server did not become healthy within "
                                      f"{self.start_timeout_s:.0f} s (server_start_timeout_s); "
                                      f"last lines of its log ({self.log_path}):\n{self.log_tail()}")
                await asyncio.sleep(_POLL_S)

    def exit_description(self) -> str:
        """``"(pid N) exited with code C; last lines of its log ...: ..."`` for error messages."""
        code = None if self.process is None else self.process.poll()
        pid = None if self.process is None else self.process.pid
        return f"(pid {pid}) exited with code {code}; last lines of its log ({self.log_path}):\n{self.log_tail()}"

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with self.log_path.open("rb") as stream:
            stream.seek(max(0, self.log_path.stat().st_size - 64 * 1024))
            text = stream.read().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL); idempotent.

        The log of a server that failed (never became healthy, or exited by itself) is kept, since
        error messages point to it; otherwise it is removed first, so a worker killed while
        waiting leaves none behind.
        """
        failed = self.process is not None and (not self.healthy or self.process.poll() is not None)
        if not failed and self.process is not None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
        process, self.process = self.process, None
        if process is not None:
            await asyncio.to_thread(_stop_group, process)
            logger.info("stopped sglang server pid %d", process.pid)
            self.process = process  # keep the exit code for messages


def server_env() -> dict[str, str]:
    """The server's environment: ours, plus ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` unless set.

    That makes sglang return logprobs of the untempered distribution, as daskgen's contract says.
    """
    return {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", **os.environ}


def _die_with_parent() -> None:
    """In the server (before exec): get SIGKILL when the thread that started it ends (Linux).

    So a worker that dies without shutting its engine down leaves no server behind (sglang's own
    scheduler processes follow their parent the same way).  The server is therefore started from
    the engine's event loop thread, which lives as long as the worker.
    """
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group of ``process``, SIGKILL what is left after a grace period, and
    wait (up to the grace period) until no process of the group remains."""
    _signal_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=_STOP_GRACE_S)
    _signal_group(process.pid, signal.SIGKILL)  # children may outlive the leader
    process.wait()
    deadline = time.monotonic() + 2 * _STOP_GRACE_S
    while _signal_group(process.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left on some systems
        return True
    return True
