"""The machinery under the engine conformance suite (:mod:`daskgen.testing.conformance`).

* :class:`EventLoopThread`: a background event loop that runs an engine's coroutines under a
  timeout, as an engine lives on a Dask worker's loop (a
  :class:`~daskgen.engines.inprocess.LoopThread`);
* :func:`check_result`: the shape checks every successful result passes;
* :func:`longest_running`: of greedy requests run together, the one that ran longest;
* :func:`run_checks`: run a suite's ``test_*`` methods outside pytest and report each;
* :func:`check_description`: ``describe()`` names the engine in plain builtin values.

Imports neither pytest nor torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import traceback
import unittest
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

from daskgen.engines.base import Engine, GenerationRequest, GenerationResult
from daskgen.engines.inprocess import LoopThread

__all__ = ["EventLoopThread", "check_description", "check_result", "gather", "longest_running", "run_checks"]

_T = TypeVar("_T")


class EventLoopThread(LoopThread):
    """An asyncio event loop running in a daemon thread; :meth:`run` executes coroutines on it."""

    def __init__(self) -> None:
        super().__init__("daskgen-conformance-loop")
        self.start().result()

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        """Run ``coro`` on the loop; raise ``TimeoutError`` after ``timeout`` seconds."""
        future = self.submit(asyncio.wait_for(coro, timeout))
        try:
            return future.result(timeout + 10)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread."""
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.run(_cancel_other_tasks(), timeout=10)
        self.stop(timeout_s=10)


async def _cancel_other_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def check_result(request: GenerationRequest, result: GenerationResult) -> None:
    """Shape checks every successful result must pass."""
    assert isinstance(result, GenerationResult), result
    assert result.request_id == request.request_id, (result.request_id, request.request_id)
    assert result.error is None, result.error
    assert all(isinstance(t, int) for t in result.output_ids), result.output_ids
    assert len(result.output_ids) <= request.params.max_new_tokens, (len(result.output_ids), request.params)
    if request.params.logprobs:
        assert result.logprobs is not None and len(result.logprobs) == len(result.output_ids), result
    else:
        assert result.logprobs is None, result
    if request.params.top_logprobs:
        assert result.top_logprobs is not None and len(result.top_logprobs) == len(result.output_ids), result
    else:
        assert result.top_logprobs is None, result


async def longest_running(engine: Engine, requests: Sequence[GenerationRequest]) -> GenerationRequest:
    """Generate ``requests`` on ``engine`` at once; the one whose output came out longest.

    For order checks that need a request that keeps running: with greedy requests the same request
    runs as long again."""
    results = await asyncio.gather(*(engine.generate(request) for request in requests))
    return max(zip(requests, results, strict=True), key=lambda pair: len(pair[1].output_ids))[0]


async def batch_results(engine: Engine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """The results of ``requests`` sent as one batch (:meth:`~daskgen.engines.base.Engine.generate_batch`), in the
    requests' order; checks that the groups give each request exactly once."""
    out: list[GenerationResult | None] = [None] * len(requests)
    async for group in engine.generate_batch(requests):
        assert group, "generate_batch yielded an empty group"
        for index, result in group:
            assert out[index] is None, f"request {index} came back twice"
            out[index] = result
    missing = [i for i, result in enumerate(out) if result is None]
    assert not missing, f"generate_batch never gave back requests {missing}"
    return [result for result in out if result is not None]


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` as a coroutine returning a list."""
    return list(await asyncio.gather(*aws))


def run_checks(suite: Any) -> dict[str, str]:
    """Run every ``test_*`` method of the suite class ``suite`` between its ``setup_class`` and ``teardown_class``.

    Each check runs after the suite's ``setup_method`` (where it has one); the checks the suite names in ``runs_last``
    run after the others.

    Returns ``{check: "passed" | "not applicable: ..." | "skipped: ..." | "failed: ..."}``; the
    suite's ``not_applicable`` mapping names the checks that do not apply, with the reason.
    """
    report: dict[str, str] = {}
    last = getattr(suite, "runs_last", ())
    suite.setup_class()
    try:
        instance = suite()
        for name in sorted((n for n in dir(suite) if n.startswith("test_")), key=lambda n: (n in last, n)):
            report[name] = _run_one(instance, name, suite.not_applicable)
    finally:
        suite.teardown_class()
    return report


def _run_one(instance: Any, name: str, not_applicable: dict[str, str]) -> str:
    if name in not_applicable:
        return f"not applicable: {not_applicable[name]}"
    try:
        getattr(instance, "setup_method", lambda: None)()
        getattr(instance, name)()
    except unittest.SkipTest as exc:
        return f"skipped: {exc}"
    except Exception as exc:  # a report, not a crash: every check runs
        return f"failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    return "passed"


def non_builtin_values(value: Any, where: str = "info") -> list[str]:
    """Paths in ``value`` (nested dicts and lists) whose type is not exactly a builtin scalar or container."""
    if type(value) is dict:
        return [odd for key, item in value.items() for odd in non_builtin_values(item, f"{where}[{key!r}]")]
    if type(value) in (list, tuple):
        return [odd for i, item in enumerate(value) for odd in non_builtin_values(item, f"{where}[{i}]")]
    if value is None or type(value) in (str, int, float, bool):
        return []
    return [f"{where}: {type(value).__module__}.{type(value).__qualname__}"]


def check_description(engine: Engine) -> None:
    """``engine.describe()`` names the engine, says whether it is simulated, is JSON-serialisable and holds
    builtin types exactly: it travels to the client, where a subclass (torch's version string, say) would make
    unpickling import the subclass's package."""
    info = engine.describe()
    assert info["engine"] == engine.name, info
    assert info["simulated"] is engine.simulated, info
    json.dumps(info)
    assert not (odd := non_builtin_values(info)), f"describe() holds values of non-builtin types: {odd}"
