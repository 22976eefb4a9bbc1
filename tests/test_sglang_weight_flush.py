"""The managed sglang server's weight update when requests still ran: loaded, then its cache dropped once they end.

A labelled test double stands in for the HTTP client (SGLang's answers, as its server gives them, replayed); the
real server's update is exercised in the sglang lane (tests/test_engine_http_sglang.py)."""

from __future__ import annotations

import asyncio

import pytest

from daskgen.engines.http.client import RequestFailed
from daskgen.engines.http.server import update_server_weights
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
