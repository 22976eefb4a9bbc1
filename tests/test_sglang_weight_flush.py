"""sglang's weight update when requests still ran: loaded, then its cache dropped once they end, for the managed
server and the in-process engine alike (:mod:`daskgen.engines.sglang.weights`).

Labelled test doubles stand in for the HTTP client and for the in-process engine's backend (SGLang's answers, as it
gives them, replayed); the real updates are exercised in the sglang lane (tests/test_engine_http_sglang.py,
tests/test_engine_sglang.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from daskgen.engines.openai.client import RequestFailed
from daskgen.engines.openai.server import update_server_weights
from daskgen.engines.sglang.engine import SGLangEngine
from daskgen.errors import RefreshError

NOT_FLUSHED = (
    'POST /update_weights_from_disk: HTTP 400: {"success":false,"message":"Weights were updated, but the cache was '
    'not flushed because requests are still running or queued. Retract or finish them, then call /flush_cache."}'
)


class ReplayedServer:
    """Test double: answers ``update_weights_from_disk`` with ``update`` and each flush with the next status."""

    def __init__(self, update: Exception | None, flushes: list[int]) -> None:
        self.update, self.flushes, self.calls = update, list(flushes), []

    async def post_json(self, path: str, body: dict, retry: bool = True) -> dict:
        self.calls.append(path)
        if self.update is not None:
            raise self.update
        return {"success": True}

    async def probe_json(self, path: str, allow_status: tuple[int, ...] = ()) -> tuple[int, None]:
        self.calls.append(path)
        return self.flushes.pop(0), None


def test_weights_loaded_while_requests_ran_are_kept_and_the_cache_is_flushed_once_they_end():
    server = ReplayedServer(RequestFailed(NOT_FLUSHED), [400, 400, 200])
    asyncio.run(update_server_weights(server, "/ckpt/v1"))  # type: ignore[arg-type]
    assert server.calls == ["/update_weights_from_disk"] + ["/flush_cache?timeout=5"] * 3


def test_a_checkpoint_the_server_refuses_is_a_refresh_error_and_nothing_is_flushed():
    server = ReplayedServer(RequestFailed('HTTP 400: {"success":false,"message":"no such file"}'), [])
    with pytest.raises(RefreshError, match="could not load policy checkpoint '/ckpt/v1'"):
        asyncio.run(update_server_weights(server, "/ckpt/v1"))  # type: ignore[arg-type]
    assert server.calls == ["/update_weights_from_disk"]


def test_requests_that_never_end_make_the_flush_a_refresh_error():
    server = ReplayedServer(RequestFailed(NOT_FLUSHED), [400] * 24)
    with pytest.raises(RefreshError, match="kept serving requests for 120 s"):
        asyncio.run(update_server_weights(server, "/ckpt/v1"))  # type: ignore[arg-type]


class ReplayedBackend:
    """Test double for the in-process engine's backend: replays ``update`` (sglang's ``(success, message)``) and each
    flush's answer, on an event loop in a thread of its own as the real backend runs sglang."""

    def __init__(self, update: tuple[bool, str], flushes: list[bool]) -> None:
        self.update, self.flushes, self.calls = update, list(flushes), []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def update_weights(self, path: str) -> tuple[bool, str]:
        self.calls.append("update")
        return self.update

    async def flush_cache(self, timeout_s: float) -> bool:
        self.calls.append(f"flush {timeout_s}")
        return self.flushes.pop(0)


def in_process_update(backend: ReplayedBackend) -> None:
    engine = SGLangEngine("/m")
    engine._backend = backend  # type: ignore[assignment]
    try:
        asyncio.run(engine.update_weights("/ckpt/v1"))
    finally:
        backend.loop.call_soon_threadsafe(backend.loop.stop)


def test_the_in_process_engine_keeps_weights_loaded_while_requests_ran_and_flushes_once_they_end():
    message = NOT_FLUSHED.split('"message":"')[1].rstrip('"}')
    backend = ReplayedBackend((False, message), [False, True])
    in_process_update(backend)
    assert backend.calls == ["update", "flush 5", "flush 5"]
    refused = ReplayedBackend((False, "no such file"), [])
    with pytest.raises(RefreshError, match="could not load policy checkpoint '/ckpt/v1'"):
        in_process_update(refused)
    assert refused.calls == ["update"]
