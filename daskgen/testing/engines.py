"""Test doubles (labelled as such): wrappers around real engines for fault and accounting tests.

``RecordingEngine`` delegates every request to a real registered engine and appends the
request id of each ``generate`` call to a log file, so a test can count how often a prompt
was generated across processes and crashes.  It can also be told to misbehave, to exercise
failure handling: raise on chosen prompts (``poison_rows``), never answer chosen prompts
(``hang_rows``), or hang completely — health checks included — until it is restarted
(``hang_once_flag``: after ``hang_after`` generate calls, the first engine instance that finds
no file at that path creates it and hangs).  It accepts and ignores an ``api_key`` (for
secret-leak tests).  Never use these for real runs.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from daskgen.engines import resolve_engine_class
from daskgen.engines.base import Engine, GenerationRequest, GenerationResult


class RecordingEngine(Engine):
    """Test double: a real inner engine plus a per-call log and optional poison rows.

    Engine args: ``inner`` (engine name), ``log_path`` (file to append request ids to),
    ``poison_rows`` (rows whose requests raise, simulating an engine crash), and every other
    key is passed to the inner engine.
    """

    name = "recording"

    def __init__(self, model: str, inner: str = "simulated", log_path: str | None = None,
                 poison_rows: list[int] | None = None, hang_rows: list[int] | None = None,
                 hang_once_flag: str | None = None, hang_after: int = 0, api_key: str | None = None,
                 **inner_args: Any) -> None:
        super().__init__(model, inner=inner, log_path=log_path, poison_rows=poison_rows, **inner_args)
        self.inner = resolve_engine_class(inner)(model, **inner_args)
        self.simulated = self.inner.simulated
        self.supports_seed = self.inner.supports_seed
        self.log_path = log_path
        self.poison = {f"p{r}-" for r in (poison_rows or [])}
        self.hang = {f"p{r}-" for r in (hang_rows or [])}
        self.hang_all = False
        self.hang_once_flag, self.hang_after, self.calls = hang_once_flag, hang_after, 0

    @classmethod
    def is_simulated(cls, engine_args: dict[str, Any]) -> bool:
        return resolve_engine_class(engine_args.get("inner", "simulated")).is_simulated(engine_args)

    async def start(self) -> None:
        await self.inner.start()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.request_id != "daskgen-health" and self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(f"{request.request_id} {os.getpid()}\n")
        if request.request_id != "daskgen-health":
            self.calls += 1
        if self.hang_once_flag and self.calls > self.hang_after and not os.path.exists(self.hang_once_flag):
            open(self.hang_once_flag, "w").close()
            self.hang_all = True
        if any(request.request_id.startswith(p) for p in self.poison):
            raise RuntimeError(f"poison prompt crashed the engine ({request.request_id})")
        if self.hang_all or any(request.request_id.startswith(p) for p in self.hang):
            await asyncio.Event().wait()  # never answers
        return await self.inner.generate(request)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    def health_token_id(self) -> int:
        return self.inner.health_token_id()
