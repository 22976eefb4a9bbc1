"""The ``openai`` engine's HTTP client: JSON and streaming (SSE) requests with retries.

:class:`HTTPClient` sends JSON and streaming requests with retries on 429, 408, 5xx and
connection errors (``tenacity``: exponential backoff with jitter, ``Retry-After`` honoured) and
turns failures into :class:`RequestFailed` messages that never contain the API key.  The managed
server process lives in :mod:`daskgen.engines.openai.server`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from daskgen import tunables
from daskgen.errors import EngineError
from daskgen.redaction import redact_url

try:
    import httpx
    import tenacity
except ModuleNotFoundError as _missing:  # an optional extra; the engine says how to install it
    httpx = tenacity = None  # type: ignore[assignment]
    MISSING_HTTP = _missing.name
else:
    MISSING_HTTP = None

__all__ = ["HTTPClient", "NoAnswer", "RequestFailed", "require_http", "split_base_url", "stream_events"]

logger = logging.getLogger(__name__)

_EXCERPT = 300
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def _max_wait() -> float:
    """Longest wait between retries (also caps ``Retry-After``): ``daskgen.http.max-retry-wait``."""
    return tunables.seconds("http.max-retry-wait")


class RequestFailed(Exception):
    """A request failed for good (after any retries); the message holds no secret."""


class NoAnswer(RequestFailed):
    """The server was not reached or sent nothing in time, on every attempt (it is down, stopped or hung)."""


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
        data = line[len("data:") :].strip()
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
        return min(_max_wait(), max(0.0, float(response.headers.get("retry-after"))))
    return None


class HTTPClient:
    """JSON and SSE requests to one server, with retries; failures raise :class:`RequestFailed`.

    Parameters
    ----------
    base_url:
        The server (``/v1`` paths go to its OpenAI base, others to its root).
    api_key_env:
        Name of the environment variable holding the API key (sent as a bearer token).
    api_key:
        The key itself, for servers daskgen started
        (:attr:`daskgen.engines.openai.server.ManagedServer.api_key`); wins over ``api_key_env``.
    timeout_s, max_connections, max_retries, backoff_s:
        Read timeout, connection pool size, retries per request and the first backoff.
    on_retry:
        Called as ``on_retry(what_failed, retry_number, wait_s)`` before each retry.
    give_up:
        Called before each retry; ``True`` stops retrying (e.g. the managed server has died).
    trust_env:
        Use proxy settings from the environment (off for loopback servers).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key_env: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 128,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        on_retry: Callable[[str, int, float], None] | None = None,
        give_up: Callable[[], bool] = lambda: False,
        trust_env: bool = True,
    ) -> None:
        require_http()
        self.root, self.openai_base = split_base_url(base_url)
        self.where = redact_url(self.root)
        self.api_key_env, self.timeout_s = api_key_env, timeout_s
        self._secret = api_key or self._read_key(api_key_env)
        self._own_key = api_key is not None
        self.max_retries, self.on_retry, self.give_up = max_retries, on_retry, give_up
        self._backoff = tenacity.wait_exponential(multiplier=backoff_s, max=_max_wait()) + tenacity.wait_random(
            0, backoff_s
        )
        headers = {"Authorization": f"Bearer {self._secret}"} if self._secret else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            trust_env=trust_env,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, tunables.seconds("http.connect-timeout"))),
            limits=httpx.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections),
        )

    @staticmethod
    def _read_key(name: str | None) -> str | None:
        if name is None:
            return None
        key = os.environ.get(name, "")
        if not key.strip():
            raise EngineError(
                f"the environment variable {name} (api_key_env) is not set or empty; "
                f"export the API key in it on every worker"
            )
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
        """Why the server could not be reached (or did not answer), and what to check."""
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return (
                f"the server at {self.where} sent nothing for {self.timeout_s:g} s (timeout_s; "
                f"{type(exc).__name__}): it is stopped, hung or overloaded. Check the server process "
                "(restart it if it hangs), or raise the engine arg timeout_s if it is only slow"
            )
        detail = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
        return self.redact(
            f"cannot reach the server at {self.where} ({detail}). "
            "Check that it is running and listening there, that base_url has the right scheme, "
            "host and port, and that this worker can reach it (firewall, proxy settings)"
        )

    def status_message(self, what: str, response: httpx.Response) -> str:
        """Message for an error status (API-key problems explained)."""
        if response.status_code in (401, 403):
            if self._own_key:
                hint = "the server did not accept the API key daskgen gave it"
            elif self.api_key_env:
                hint = f"check the key in the environment variable {self.api_key_env}"
            else:
                hint = "the server needs an API key: set api_key_env to the name of the variable holding it"
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

    async def stream(
        self,
        path: str,
        body: dict[str, Any],
        on_event: Callable[[dict[str, Any]], str | None],
        on_attempt: Callable[[], None] = lambda: None,
        retry: bool = True,
    ) -> str | None:
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
            stop=tenacity.stop_after_attempt(retries + 1),
            wait=self._wait,
            reraise=True,
            retry=tenacity.retry_if_exception(lambda exc: _transient(exc) and not self.give_up()),
            before_sleep=self._before_sleep(what),
        )
        try:
            return await retrying(attempt)
        except StatusFailure as exc:
            raise RequestFailed(f"{exc} ({retrying.statistics.get('attempt_number', 1)} attempts)") from None
        except httpx.HTTPError as exc:
            attempts = retrying.statistics.get("attempt_number", 1)
            raise NoAnswer(f"{what}: {self.unreachable(exc)} ({attempts} attempts)") from None
        except (ValueError, KeyError) as exc:  # a malformed answer
            raise RequestFailed(self.redact(f"{what} on {self.where}: malformed answer ({exc})")) from None

    def _wait(self, state: tenacity.RetryCallState) -> float:
        """Exponential backoff with jitter, or the server's ``Retry-After`` when that is longer."""
        server = getattr(state.outcome.exception(), "retry_after", None) if state.outcome else None
        return min(_max_wait(), max(server or 0.0, self._backoff(state)))

    def _before_sleep(self, what: str) -> Callable[[tenacity.RetryCallState], None]:
        def log(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            reason = str(exc) if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {exc}"
            if self.on_retry is not None:
                wait = state.next_action.sleep if state.next_action else 0.0
                self.on_retry(self.redact(f"{what} failed ({reason})"), state.attempt_number, wait)

        return log
